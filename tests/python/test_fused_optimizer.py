"""bagua.torch_api.contrib.fuse_optimizer: ``fuse_step`` gives exactly
``step``'s parameters for every optimizer configuration Bagua's own test
lists, with fresh and with existing state, and really fuses (the runs are
counted); calculate_mutual_groups finds the runs Bagua's test expects."""

import pytest
import torch
import torch.optim as optim

import bagua.torch_api as bagua
from bagua.torch_api.contrib.fuse.optimizer import calculate_mutual_groups, fused_parameter_counts

CONFIGS = [
    (optim.Adam, dict(weight_decay=1.0, amsgrad=True)),
    (optim.Adam, dict(weight_decay=1.0, amsgrad=False)),
    (optim.Adam, dict(weight_decay=0.0, amsgrad=True)),
    (optim.Adam, dict(weight_decay=0.0, amsgrad=False)),
    (optim.AdamW, dict(weight_decay=1.0, amsgrad=True)),
    (optim.AdamW, dict(weight_decay=0.0, amsgrad=False)),
    (optim.SGD, dict(lr=0.2, momentum=1, dampening=0, weight_decay=1, nesterov=True)),
    (optim.SGD, dict(lr=0.2, momentum=1, dampening=0.5, weight_decay=1, nesterov=False)),
    (optim.SGD, dict(lr=0.2)),
    (optim.RMSprop, dict(weight_decay=1, momentum=1, centered=True)),
    (optim.RMSprop, dict(weight_decay=1, momentum=0, centered=True)),
    (optim.RMSprop, dict(weight_decay=0, momentum=1, centered=False)),
    (optim.Rprop, dict(lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50))),
    (optim.ASGD, dict(weight_decay=0)),
    (optim.ASGD, dict(weight_decay=1)),
    (optim.Adamax, dict(weight_decay=0)),
    (optim.Adamax, dict(weight_decay=1)),
    (optim.Adadelta, dict(weight_decay=0)),
    (optim.Adadelta, dict(weight_decay=1)),
]


def model_and_optimizer(opt, kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid())
    return model, opt(model.parameters(), **kwargs)


def train(model, optimizer, steps, fused, set_to_none=False):
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).reshape(3, 2)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=set_to_none)
        model(x).sum().backward()
        optimizer.fuse_step() if fused else optimizer.step()


@pytest.mark.parametrize("opt,kwargs", CONFIGS, ids=[f"{o.__name__}-{i}" for i, (o, _) in enumerate(CONFIGS)])
@pytest.mark.parametrize("with_state", [False, True])
def test_fuse_step_equals_step(opt, kwargs, with_state):
    plain_model, plain_opt = model_and_optimizer(opt, kwargs)
    fused_model, fused_opt = model_and_optimizer(opt, kwargs)
    if with_state:  # state exists before fusing
        train(plain_model, plain_opt, 2, fused=False)
        train(fused_model, fused_opt, 2, fused=False)
    fused_opt = bagua.contrib.fuse_optimizer(fused_opt)
    train(plain_model, plain_opt, 4, fused=False)
    train(fused_model, fused_opt, 4, fused=True)
    for a, b in zip(plain_model.parameters(), fused_model.parameters()):
        assert torch.equal(a, b)
    # the four parameters were updated as one run at every step
    assert fused_parameter_counts(fused_opt) == [4, 4, 4, 4]
    # the state stays per parameter, equal to the plain optimizer's
    plain_state, fused_state = plain_opt.state_dict()["state"], fused_opt.state_dict()["state"]
    assert plain_state.keys() == fused_state.keys()
    for key in plain_state:
        for name, value in plain_state[key].items():
            other = fused_state[key][name]
            if value is None:
                assert other is None, (key, name)
            else:
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (key, name)


def test_fused_parameters_share_one_buffer_after_flattening():
    model, opt = model_and_optimizer(optim.Adam, {})
    train(model, opt, 1, fused=False)
    bagua.contrib.fuse_optimizer(opt)
    params = list(model.parameters())
    for tensors in ([p.data for p in params], [p.grad for p in params], [opt.state[p]["exp_avg"] for p in params]):
        assert all(a.data_ptr() + a.numel() * a.element_size() == b.data_ptr() for a, b in zip(tensors, tensors[1:]))


def test_set_to_none_gradients_still_give_steps_result():
    """zero_grad(set_to_none=True) lets autograd allocate gradients apart:
    fuse_step gathers them into one buffer first and still fuses, with the
    same result (PyTorch 2's default; before, nothing fused there)."""
    plain_model, plain_opt = model_and_optimizer(optim.Adam, dict(weight_decay=0.1))
    fused_model, fused_opt = model_and_optimizer(optim.Adam, dict(weight_decay=0.1))
    fused_opt = bagua.contrib.fuse_optimizer(fused_opt)
    train(plain_model, plain_opt, 3, fused=False, set_to_none=True)
    train(fused_model, fused_opt, 3, fused=True, set_to_none=True)
    for a, b in zip(plain_model.parameters(), fused_model.parameters()):
        assert torch.equal(a, b)
    assert fused_parameter_counts(fused_opt) == [4, 4, 4]


def test_a_parameter_without_gradient_is_left_out_of_the_run():
    model, opt = model_and_optimizer(optim.SGD, dict(lr=0.1, momentum=0.9))
    opt = bagua.contrib.fuse_optimizer(opt)
    reference_model, reference_opt = model_and_optimizer(optim.SGD, dict(lr=0.1, momentum=0.9))
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).reshape(3, 2)
    for m, o, fused in ((model, opt, True), (reference_model, reference_opt, False)):
        o.zero_grad(set_to_none=False)
        m(x).sum().backward()
        list(m.parameters())[3].grad = None  # the last bias took no part
        o.fuse_step() if fused else o.step()
    for a, b in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(a, b)
    assert fused_parameter_counts(opt) == [3]


def test_fused_count_counts_the_param_groups_updated_fused():
    """Bagua's ``optimizer._bagua_fused_count``: each fuse_step adds one per
    param group in which a run was updated as one tensor. A group of one
    parameter and step() add nothing; a fuse_step whose gradients autograd
    allocated apart still counts (they are gathered first); fusing twice is
    refused."""
    from bagua.torch_api.contrib.fuse.optimizer import is_fused_optimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1))
    groups = [{"params": [model[0].weight, model[0].bias]}, {"params": [model[2].weight]},
              {"params": [model[2].bias], "weight_decay": 0.0}]
    opt = optim.Adam(groups, weight_decay=0.1)
    assert not is_fused_optimizer(opt)
    opt = bagua.contrib.fuse_optimizer(opt)
    assert is_fused_optimizer(opt) and opt._bagua_fused_count == 0
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).reshape(3, 2)
    for step in range(5):
        opt.zero_grad(set_to_none=False)
        model(x).sum().backward()
        opt.fuse_step() if step % 2 == 0 else opt.step()
    assert opt._bagua_fused_count == 3  # the first group, at steps 0, 2 and 4
    opt.zero_grad(set_to_none=True)
    model(x).sum().backward()
    opt.fuse_step()
    assert opt._bagua_fused_count == 4


@pytest.mark.parametrize("opt_class, kwargs", [(optim.SGD, dict(lr=0.2, momentum=1, nesterov=True, dampening=0)),
                                               (optim.Adam, dict(amsgrad=True)), (optim.Adadelta, {})])
def test_bagua_fused_count_with_the_default_zero_grad(opt_class, kwargs):
    """Bagua's test_fused_optimizer loop: two param groups (weights with
    weight decay, biases without), 101 epochs, fuse_step on the even ones,
    ``zero_grad()`` with its default (set_to_none=True on PyTorch 2): 102
    fused group updates, and step()'s weights bit for bit."""
    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid())
        groups = [{"params": [p for n, p in m.named_parameters() if "bias" not in n], "weight_decay": 0.1},
                  {"params": [p for n, p in m.named_parameters() if "bias" in n], "weight_decay": 0.0}]
        return m, opt_class(groups, **kwargs)
    model, opt = build()
    opt = bagua.contrib.fuse_optimizer(opt, do_flatten=True)
    reference, reference_opt = build()
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).reshape(3, 2)
    for epoch in range(101):
        for m, o, fused in ((model, opt, True), (reference, reference_opt, False)):
            o.zero_grad()
            m(x).sum().backward()
            o.fuse_step() if fused and epoch % 2 == 0 else o.step()
    assert opt._bagua_fused_count == 102
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="fuse an optimizer twice"):
        bagua.contrib.fuse_optimizer(opt)


def test_fuse_step_needs_fuse_optimizer_and_an_optimizer():
    from bagua.torch_api.contrib.fuse.optimizer import fuse_step
    _, opt = model_and_optimizer(optim.SGD, dict(lr=0.1))
    with pytest.raises(bagua.InvalidArgumentError, match="fuse_optimizer"):
        fuse_step(opt)
    with pytest.raises(bagua.InvalidArgumentError, match="torch.optim.Optimizer"):
        bagua.contrib.fuse_optimizer(object())


def test_calculate_mutual_groups_matches_bagua():
    tensor = torch.rand(100)
    pieces = [tensor[i * 10:(i + 1) * 10] for i in range(10)]
    g1 = [pieces[3], pieces[1], pieces[2], pieces[0], pieces[8], pieces[9], torch.rand(10)]
    g2 = [torch.rand(10) for _ in g1]
    g3 = [pieces[3], pieces[1], pieces[2], pieces[0], torch.rand(10), torch.rand(10), torch.rand(10)]
    g4 = [torch.rand(10), pieces[1], pieces[2], pieces[0], pieces[8], pieces[9], torch.rand(10)]
    g5 = [pieces[3], pieces[1], pieces[2], pieces[0], pieces[8], pieces[9], torch.rand(10)]
    assert calculate_mutual_groups([g1, g2]) == []
    assert calculate_mutual_groups([g1, g3]) == [[3, 1, 2, 0]]
    assert calculate_mutual_groups([g1, g4]) == [[4, 5]]
    assert calculate_mutual_groups([g1, g5]) == [[3, 1, 2, 0], [4, 5]]
    with pytest.raises(bagua.InvalidArgumentError, match="equal lengths"):
        calculate_mutual_groups([g1, g1[:3]])


@pytest.mark.parametrize("flatten", [False, True])
def test_fuse_step_under_with_bagua_equals_step(tmp_path, flatten):
    """Fused before with_bagua, 2 ranks, GradientAllReduce: fuse_step runs
    the wrapped step (the algorithm's hooks included) and gives step()'s
    parameters on every rank."""
    from pathlib import Path
    from launcher import run_workers
    results = run_workers("with_bagua", 2, tmp_path, args=("1" if flatten else "0",),
                          script=Path(__file__).with_name("fused_optimizer_workers.py"))
    for result in results:
        for a, b, c in zip(result["plain"], result["fused"], results[0]["fused"]):
            assert torch.equal(a, b) and torch.equal(b, c)
        # do_flatten=False leaves fuse_optimizer's layout: one run of all four.
        # With do_flatten=True the buckets hold the gradients in reverse
        # order, the weights stay in forward order: no run, same result.
        assert result["counts"] == ([0] * 5 if flatten else [4] * 5)
        assert result["fused_count"] == (0 if flatten else 5)  # Bagua's count: groups fused, over the steps
