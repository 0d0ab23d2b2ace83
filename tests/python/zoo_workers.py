"""Models nobody here wrote (run by test_model_zoo.py, PyTorch 2 lane):
transformers' GPT-2 and BERT and torchvision's ResNet-18 (also in
channels_last), tiny configurations with random weights, each through every
registered algorithm beside PyTorch DDP; and the loop habits users bring
(GradScaler, torch.distributed initialized first, layers frozen mid-run,
save_pretrained of a wrapped model).

Usage: zoo_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import sys

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import Algorithm, q_adam

STEPS = 3


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bert():
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=16,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def resnet(channels_last=False):
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    return model.to(memory_format=torch.channels_last) if channels_last else model


MODELS = {"gpt2": gpt2, "bert": bert, "resnet18": resnet, "resnet18_channels_last": lambda: resnet(True)}


def loss_of(kind, model, g):
    """One batch of ``kind``'s task, from generator ``g``: the loss."""
    if kind == "gpt2":
        tokens = torch.randint(0, 64, (2, 12), generator=g)
        return model(input_ids=tokens, labels=tokens).loss
    if kind == "bert":
        tokens = torch.randint(0, 64, (2, 12), generator=g)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 8:] = 0  # a padded second sequence
        labels = torch.where(torch.rand(2, 12, generator=g) < 0.3, tokens, torch.full_like(tokens, -100))
        labels[0, 0] = tokens[0, 0]
        return model(input_ids=tokens, attention_mask=mask, labels=labels).loss
    images = torch.randn(2, 3, 32, 32, generator=g)
    if kind.endswith("channels_last"):
        images = images.to(memory_format=torch.channels_last)
    return F.cross_entropy(model(images), torch.randint(0, 10, (2,), generator=g))


def optimizer_and_algorithm(name, model):
    if name == "qadam":
        opt = q_adam.QAdamOptimizer(model.parameters(), lr=0.001, warmup_steps=1)
        return opt, Algorithm.init("qadam", q_adam_optimizer=opt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if name == "ddp":
        return opt, None
    kwargs = {"powersgd": dict(start_iter=1), "auto": dict(decide_after=1, verify_steps=1),
              "partial_allreduce": dict(group_size=2, group_generator="static"),
              "async": dict(sync_interval_ms=5)}.get(name, {})
    return opt, Algorithm.init(name, **kwargs)


def train(kind, name, rank):
    model = MODELS[kind]()
    opt, algorithm = optimizer_and_algorithm(name, model)
    if algorithm is None:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        wrapped = model.with_bagua([opt], algorithm)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        opt.zero_grad()
        loss_of(kind, wrapped, g).backward()
        opt.step()
    if name == "async":
        algorithm.abort(model)
    result = [p.detach().clone() for p in model.parameters()]
    if algorithm is not None:
        model.without_bagua()
    return result


def scenario_zoo(out_dir, kinds, names):
    bagua.init_process_group()
    rank = bagua.get_rank()
    results = {}
    for kind in kinds.split(","):
        for name in ["ddp"] + names.split(","):
            results[f"{kind}/{name}"] = train(kind, name, rank)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


# -- the loop habits ------------------------------------------------------------------
def grad_scaler(wrap, rank):
    """torch.amp.GradScaler with float16 autocast on the CPU."""
    model = resnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    wrapped = wrap(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    g = torch.Generator().manual_seed(300 + rank)
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of("resnet18", wrapped, g)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()]


def freezing(wrap, rank):
    """GPT-2's embeddings frozen for the first two steps, then trained."""
    model = gpt2()
    for p in model.transformer.wte.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = wrap(model, opt)
    g = torch.Generator().manual_seed(400 + rank)
    for step in range(4):
        if step == 2:
            for p in model.transformer.wte.parameters():
                p.requires_grad_(True)
            if hasattr(model, "bagua_ddp"):
                wrapped = wrap(model, opt)  # re-wrapped, as DDP must be, to take the new parameters
            else:
                wrapped = torch.nn.parallel.DistributedDataParallel(model)
        opt.zero_grad()
        loss_of("gpt2", wrapped, g).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def save_pretrained(wrap, rank):
    """A wrapped GPT-2 saved with save_pretrained, loaded back with
    from_pretrained and trained on: as DDP's."""
    from transformers import GPT2LMHeadModel
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = wrap(model, opt)
    g = torch.Generator().manual_seed(500 + rank)
    opt.zero_grad()
    loss_of("gpt2", wrapped, g).backward()
    opt.step()
    # transformers writes on rank 0 only once torch.distributed is up: one
    # directory for all, as a job's shared checkpoint directory.
    where = os.path.join(os.environ["ZOO_OUT_DIR"], f"pretrained_{'bagua' if hasattr(model, 'bagua_ddp') else 'ddp'}")
    model.save_pretrained(where)  # the module itself, wrapped by bagua (with DDP: the inner one)
    torch.distributed.barrier()
    loaded = GPT2LMHeadModel.from_pretrained(where)
    opt = torch.optim.SGD(loaded.parameters(), lr=0.05)
    wrapped = wrap(loaded, opt)
    opt.zero_grad()
    loss_of("gpt2", wrapped, g).backward()
    opt.step()
    return [p.detach().clone() for p in loaded.parameters()]


def scenario_habits(out_dir):
    import torch.distributed as dist
    os.environ["ZOO_OUT_DIR"] = out_dir
    # torch.distributed first, as Lightning or a user's script does; bagua
    # joins its store.
    dist.init_process_group("gloo")
    bagua.init_process_group()
    rank = bagua.get_rank()

    def ddp(model, opt):
        return torch.nn.parallel.DistributedDataParallel(model)

    def ours(model, opt):
        return model.with_bagua([opt], Algorithm.init("gradient_allreduce"))

    results = {}
    for habit in (grad_scaler, freezing, save_pretrained):
        results[f"{habit.__name__}/ddp"] = habit(ddp, rank)
        results[f"{habit.__name__}/bagua"] = habit(ours, rank)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
