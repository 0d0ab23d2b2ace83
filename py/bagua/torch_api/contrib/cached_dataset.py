"""Bagua's CachedDataset: a Dataset whose samples are computed once and then
read from a key-value store shared by the job's processes."""

from torch.utils.data.dataset import Dataset

from bagua.torch_api.contrib.cache_loader import CacheLoader

__all__ = ["CachedDataset"]


class CachedDataset(Dataset):
    """Wraps ``dataset``: sample ``i`` is ``dataset[i]`` the first time, then
    read from the store under ``"{dataset_name}_{i}"``. For samples that are
    slow to read or preprocess. ``backend``, ``writer_buffer_size`` and
    ``**kwargs`` are ``CacheLoader``'s."""

    def __init__(self, dataset: Dataset, backend: str = "redis", dataset_name: str = "",
                 writer_buffer_size: int = 20, **kwargs):
        self.dataset = dataset
        self.cache_loader = CacheLoader(backend, dataset_name, writer_buffer_size, **kwargs)

    def __getitem__(self, item):
        return self.cache_loader.get(item, lambda index: self.dataset[index])

    def __len__(self):
        return len(self.dataset)
