"""Samplers that give every rank batches of similar total cost.

:class:`LoadBalancingDistributedSampler` sorts the samples by a cost
("complexity") the user computes per sample, cuts the sorted list into
chunks of ``num_replicas`` consecutive samples and gives rank ``r`` the
``r``-th sample of each chunk, so at every step the ranks work on samples of
neighbouring cost. With ``shuffle`` the chunk order is a seeded permutation
(``seed + epoch``), and ``random_level`` adds seeded noise to the costs
before sorting (0: best balance, 1: noise as wide as the cost range).

:class:`LoadBalancingDistributedBatchSampler` groups one rank's samples into
batches of variable size with the user's ``batch_fn``, and pads (or with
``drop_last``, cuts) every rank to the same number of batches.

The same seed, epoch and dataset give the same indices as Bagua's samplers.
"""

import math
from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch.utils.data.dataset import Dataset
from torch.utils.data.sampler import Sampler

__all__ = ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"]


def _default_world():
    """(world size, rank): torch.distributed's when initialized, else the launcher's."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    from bagua.torch_api import get_rank, get_world_size

    return get_world_size(), get_rank()


class LoadBalancingDistributedSampler(Sampler):
    """A distributed sampler balancing the cost of what each rank gets.

    Args:
        dataset: the dataset (of constant size).
        complexity_fn: the cost of one sample, ``complexity_fn(dataset[i])``
            (a number; every sample is read once, at construction).
        num_replicas: ranks sharing the data (default: the world size).
        rank: this rank (default: this process's rank).
        shuffle: permute the chunks each epoch (default True).
        seed: shuffling seed, the same on every rank (default 0).
        drop_last: drop the costliest samples so the data divides evenly
            among the ranks; otherwise the cheapest samples repeat to pad it.
        random_level: 0 to 1, how much seeded noise blurs the cost order
            when shuffling.

    Call :meth:`set_epoch` before each epoch for a new order.
    """

    def __init__(self, dataset: Dataset, complexity_fn: Callable[..., int], num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 random_level: float = 0) -> None:
        if num_replicas is None or rank is None:
            world, this_rank = _default_world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = this_rank if rank is None else rank
        if rank >= num_replicas or rank < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        if random_level < 0.0 or random_level > 1.0:
            raise ValueError(f"Invalid random level {random_level}, shoule be in the range [0.0, 1.0]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = seed
        length = len(dataset)  # type: ignore[arg-type]
        if drop_last and length % num_replicas != 0:
            self.num_samples = math.ceil((length - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(length / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.item_complexity_map = {i: complexity_fn(dataset[i]) for i in range(length)}
        self.ordered_item_complexity_map = dict(sorted(self.item_complexity_map.items(), key=lambda kv: kv[1]))
        costs = self.item_complexity_map.values()
        self.random_number = int((max(costs) - min(costs)) * random_level + 1)

    def _chunks(self, ordered_indices: List[int]) -> List[List[int]]:
        """``num_samples`` chunks of ``num_replicas`` indices, taken in order
        from ``ordered_indices`` and wrapping around at its end."""
        n = self.num_replicas
        count = max(1, self.num_samples) * n
        flat = [ordered_indices[i % len(ordered_indices)] for i in range(count)]
        return [flat[i:i + n] for i in range(0, count, n)]

    def shuffle_chunks(self):
        """(chunks, chunk order) for this epoch; rank ``r`` takes sample ``r``
        of each chunk, chunks in that order."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            ordered = self.ordered_item_complexity_map
            if self.random_number > 0:
                noise = torch.randint(self.random_number, (len(self.item_complexity_map),), generator=g).tolist()
                noisy = {k: v + extra for (k, v), extra in zip(self.item_complexity_map.items(), noise)}
                ordered = dict(sorted(noisy.items(), key=lambda kv: kv[1]))
            chunks = self._chunks(list(ordered.keys()))
            order = torch.randperm(len(chunks), generator=g).tolist()
        else:
            chunks = self._chunks(list(self.ordered_item_complexity_map.keys()))
            order = list(range(len(chunks)))
        if self.drop_last:
            order = order[:self.num_samples]
        elif len(order) < self.num_samples:  # pad by repeating the order
            order = (order * math.ceil(self.num_samples / len(order)))[:self.num_samples]
        assert len(order) == self.num_samples
        return chunks, order

    def __iter__(self) -> Iterator[int]:
        chunks, order = self.shuffle_chunks()
        return iter([chunks[i][self.rank] for i in order])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration yields (with ``shuffle``)."""
        self.epoch = epoch


class LoadBalancingDistributedBatchSampler(Sampler):
    """Batches of variable size from a :class:`LoadBalancingDistributedSampler`.

    Args:
        sampler: the load-balancing sampler (with ``drop_last=False``).
        batch_fn: ``batch_fn(indices: List[int]) -> List[List[int]]``, one
            rank's indices grouped into batches.
        drop_last: every rank gets as many batches as the rank with the
            fewest (the rest are dropped); otherwise as many as the rank with
            the most, the others repeating their first batches.
    """

    def __init__(self, sampler: LoadBalancingDistributedSampler, batch_fn, drop_last: bool = False) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise ValueError("sampler should be of LoadBalancingDistributedSampler type.")
        if sampler.drop_last:
            raise ValueError("drop_last of sampler should be False")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last
        self.num_replicas = sampler.num_replicas
        self.rank = sampler.rank
        self.generate_batches()

    def generate_batches(self) -> None:
        """Recomputes every rank's batches for the sampler's current epoch."""
        chunks, order = self.sampler.shuffle_chunks()
        batches = [list(self.batch_fn([chunks[i][r] for i in order])) for r in range(self.num_replicas)]
        sizes = [len(b) for b in batches]
        self.total_batch = min(sizes) if self.drop_last else max(sizes)
        self.padded_batches = [_cycle_to(b, self.total_batch) for b in batches]

    def __iter__(self):
        return iter(self.padded_batches[self.rank])

    def __len__(self) -> int:
        return self.total_batch

    def set_epoch(self, epoch: int) -> None:
        """Sets the sampler's epoch and regenerates the batches."""
        self.sampler.set_epoch(epoch)
        self.generate_batches()


def _cycle_to(items: list, length: int) -> list:
    """``items`` cut to ``length``, or repeated from its start up to it."""
    if not items:
        return items
    return [items[i % len(items)] for i in range(length)]
