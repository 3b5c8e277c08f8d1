"""Server-side optimizers match torch.optim run locally on the same gradients, through a real shard."""

import pytest
import torch

from torchps.client import ModeConflictError, Optimizer, OptimizerSpecError

STEPS = 20
SHAPE = (6, 5)

CONFIGS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.001)),
    "sgd_maximize": (torch.optim.SGD, dict(lr=0.1, momentum=0.5, maximize=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1,
                                          weight_decay=0.01, eps=1e-9)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
    "adam_betas": (torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=0.01, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=0.02, betas=(0.85, 0.95), amsgrad=True)),
}


def _wire_name(cls):
    return {torch.optim.SGD: "sgd", torch.optim.Adagrad: "adagrad",
            torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}[cls]


def _data(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(SHAPE, generator=gen, dtype=dtype)
    grads = [torch.randn(SHAPE, generator=gen, dtype=dtype) * (1 + i % 3) for i in range(STEPS)]
    return init, grads


def _run_both(client, name, cls, kwargs, *, lr_schedule=None, dtype=torch.float32, seed=0):
    """Pushes the same gradients to the shard and to a local torch.optim; compares after every step."""
    init, grads = _data(seed, dtype)
    assert client.create_variables({name: init}, Optimizer(_wire_name(cls), **kwargs)) == {name: True}
    local = torch.nn.Parameter(init.clone())
    optimizer = cls([local], **kwargs)
    for step, grad in enumerate(grads):
        if lr_schedule and step in lr_schedule:
            assert client.set_hyperparams([name], lr=lr_schedule[step]) == 1
            optimizer.param_groups[0]["lr"] = lr_schedule[step]
        client.push({name: grad})
        local.grad = grad.clone()
        optimizer.step()
        remote = client.pull([name])[name]
        assert remote.dtype == dtype
        torch.testing.assert_close(remote, local.detach(), rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{name} after step {step + 1}: {m}")
    assert not torch.equal(local.detach(), init)  # the optimizer did move the variable


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_torch_optim(client, config):
    cls, kwargs = CONFIGS[config]
    _run_both(client, f"opt/{config}", cls, kwargs, seed=len(config))


def test_matches_torch_optim_float64(client):
    _run_both(client, "opt/adam64", torch.optim.Adam, dict(lr=0.05, amsgrad=True), dtype=torch.float64)


@pytest.mark.parametrize("config", ["sgd_momentum", "adam", "adagrad"])
def test_lr_change_mid_sequence(client, config):
    """client.set_hyperparams(lr=...) acts like setting param_groups[0]['lr'] locally, from the next step."""
    cls, kwargs = CONFIGS[config]
    _run_both(client, f"lr/{config}", cls, kwargs, lr_schedule={7: 0.001, 14: 0.3}, seed=7)


def test_set_hyperparams_unknown_key(client):
    """An unknown hyperparameter is refused and the lr in force stays."""
    name = "lr/unknown_key"
    client.create_variables({name: torch.zeros(3)}, Optimizer("sgd", lr=1.0))
    with pytest.raises(OptimizerSpecError, match="betas|beta1"):
        client.set_hyperparams([name], lr=0.5, betas=(0.9, 0.9))
    client.push({name: torch.ones(3)})
    assert torch.equal(client.pull([name])[name], torch.full((3,), -1.0))


def test_optimizer_betas_tuple(client):
    """Optimizer('adam', betas=(0.8, 0.99)) travels as beta1/beta2 and is stored as given."""
    name = "opt/betas_spec"
    client.create_variables({name: torch.zeros(2)}, Optimizer("adam", betas=(0.8, 0.99)))
    (info,) = [v for v in client.list_variables() if v.spec.name == name]
    hyper = dict(info.spec.optimizer.hyperparams)
    assert info.spec.optimizer.name == "adam"
    assert (hyper["beta1"], hyper["beta2"]) == (0.8, 0.99)
    assert hyper["lr"] == 1e-3  # torch.optim's default filled in


@pytest.mark.parametrize("optimizer, match", [
    (Optimizer("rmsprop", lr=0.1), "unknown optimizer 'rmsprop'"),
    (Optimizer("sgd", lr=0.1, betas=(0.9, 0.99)), "beta1"),
    (Optimizer("adam", momentum=0.9), "momentum"),
    (Optimizer("adagrad", amsgrad=True), "amsgrad"),
    (Optimizer("none", lr=0.1), "lr"),
    (Optimizer("sgd", lr=-1.0), "learning rate"),
    (Optimizer("sgd", lr=0.1, nesterov=True), "[Nn]esterov"),  # torch: nesterov needs momentum
])
def test_bad_optimizer_spec_at_create(client, optimizer, match):
    """OptimizerSpecError at create, and nothing is created."""
    name = f"bad/{optimizer.name}/{sorted(optimizer.hyperparams)}"
    with pytest.raises(OptimizerSpecError, match=match):
        client.create_variables({name: torch.zeros(2)}, optimizer)
    assert name not in {v.spec.name for v in client.list_variables()}


def test_optimizer_on_integer_variable(client):
    with pytest.raises(OptimizerSpecError, match="floating-point"):
        client.create_variables({"bad/int_sgd": torch.zeros(2, dtype=torch.int64)}, Optimizer("sgd", lr=0.1))


@pytest.mark.parametrize("optimizer, change", [
    (Optimizer("adam", lr=0.01), {"amsgrad": True}),
    (Optimizer("adamw", lr=0.01, amsgrad=True), {"amsgrad": False}),
    (Optimizer("sgd", lr=0.1), {"momentum": 0.9}),
    (Optimizer("sgd", lr=0.1, momentum=0.9), {"momentum": 0.0}),
    (Optimizer("sgd", lr=0.1, momentum=0.9), {"nesterov": True}),
], ids=["amsgrad-on", "amsgrad-off", "momentum-from-0", "momentum-to-0", "nesterov"])
def test_a_change_of_the_optimizer_states_structure_is_refused_after_the_first_step(client, optimizer, change):
    """The issue's wedge began here: amsgrad turned on for an Adam variable that had stepped was accepted, and
    every later step raised KeyError('max_exp_avg_sq'). A flag that changes what the optimizer keeps per element
    is refused with FAILED_PRECONDITION once the variable has stepped; nothing changes, and the variable goes
    on training with the hyperparameters it had (an lr change is still accepted)."""
    name = f"structure/{optimizer.name}/{sorted(change.items())}"
    client.create_variables({name: torch.zeros(4)}, optimizer)
    client.push({name: torch.ones(4)})
    before = client.pull([name])[name]
    with pytest.raises(ModeConflictError, match=f"{next(iter(change))}.*first step"):
        client.set_hyperparams([name], **change)
    (info,) = [v for v in client.list_variables() if v.spec.name == name]
    assert info.version == 1
    assert client.set_hyperparams([name], lr=0.5) == 1
    client.push({name: torch.ones(4)})
    assert not torch.equal(client.pull([name])[name], before), "the variable still trains"


def test_a_change_of_the_optimizer_states_structure_before_the_first_step_takes_effect(client):
    """Before the first step the state is empty: turning momentum on is accepted and the shard then steps as
    torch.optim with momentum would."""
    name = "structure/before-first-step"
    client.create_variables({name: torch.zeros(3)}, Optimizer("sgd", lr=1.0))
    assert client.set_hyperparams([name], momentum=0.5) == 1
    local = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([local], lr=1.0, momentum=0.5)
    for _ in range(3):
        client.push({name: torch.ones(3)})
        local.grad = torch.ones(3)
        optimizer.step()
    torch.testing.assert_close(client.pull([name])[name], local.detach())
