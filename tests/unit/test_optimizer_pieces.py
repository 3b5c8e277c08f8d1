"""VariableOptimizer steps a variable piece by piece: the same bits as torch.optim over the whole tensor,
and a state_dict that is the whole tensor's (checkpoints, journals and restores keep their format)."""

import subprocess
import sys

import pytest
import torch

from torchps.ps_server import optimizers
from torchps.ps_server.optimizers import VariableOptimizer

CASES = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2, "nesterov": 1.0}),
    ("adagrad", {"lr": 0.1, "lr_decay": 1e-3}),
    ("adam", {"lr": 1e-2, "weight_decay": 1e-2}),
    ("adam", {"lr": 1e-2, "amsgrad": 1.0, "maximize": 1.0}),
    ("adamw", {"lr": 1e-2}),
]
TORCH = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam,
         "adamw": torch.optim.AdamW}


def _reference(name, hyper, value):
    param = torch.nn.Parameter(value.clone())
    kwargs = {k: (bool(v) if k in ("nesterov", "amsgrad", "maximize") else v) for k, v in hyper.items()}
    return param, TORCH[name]([param], **kwargs)


@pytest.mark.parametrize("pieces", [3, 1])
@pytest.mark.parametrize("name,hyper", CASES)
def test_piecewise_steps_match_torch_optim_bit_for_bit_across_a_restore(monkeypatch, name, hyper, pieces):
    if pieces == 3:
        monkeypatch.setattr(optimizers, "PIECE_ELEMENTS", 1000)  # a (37, 71) variable: 3 pieces, the last short
    torch.manual_seed(0)
    value = torch.randn(37, 71)
    grads = [torch.randn(37, 71) for _ in range(6)]
    ref_param, ref = _reference(name, hyper, value)
    param = torch.nn.Parameter(value.clone())
    ours = VariableOptimizer(name, hyper, param)
    assert len(ours._pieces) == pieces
    for i, grad in enumerate(grads):
        if i == 3:  # a checkpoint and a restore onto a fresh optimizer, mid-run
            saved = ours.state_dict()
            assert set(saved["state"]) <= {0} and saved["param_groups"][0]["params"] == [0]
            for key, state in saved["state"].get(0, {}).items():
                if key != "step":
                    assert state.shape == value.shape
            reference_saved = ref.state_dict()
            assert saved["state"].keys() == reference_saved["state"].keys()
            for key, state in reference_saved["state"].get(0, {}).items():
                assert torch.equal(saved["state"][0][key], state), key
            param = torch.nn.Parameter(param.detach().clone())
            ours = VariableOptimizer(name, hyper, param)
            ours.load_state_dict(saved)
        ours.apply(grad.clone())
        ref_param.grad = grad.clone()
        ref.step()
        assert torch.equal(param.detach(), ref_param.detach()), (name, i)


@pytest.mark.parametrize("name,hyper", CASES)
def test_torch_optims_own_state_dict_loads_and_steps_on_bit_for_bit(name, hyper):
    """What checkpoints made before the shard stepped torch.optim's functional forms hold: torch.optim's own
    state_dict of an optimizer over the variable (its param_groups with torch's every key)."""
    torch.manual_seed(1)
    value = torch.randn(5, 7)
    grads = [torch.randn(5, 7) for _ in range(4)]
    ref_param, ref = _reference(name, hyper, value)
    for grad in grads[:2]:
        ref_param.grad = grad.clone()
        ref.step()
    param = torch.nn.Parameter(ref_param.detach().clone())
    ours = VariableOptimizer(name, {}, param)  # the defaults: the loaded param_groups bring the hyperparameters
    ours.load_state_dict(ref.state_dict())
    assert ours.current() == VariableOptimizer(name, hyper, param).current()
    for grad in grads[2:]:
        ours.apply(grad.clone())
        ref_param.grad = grad.clone()
        ref.step()
        assert torch.equal(param.detach(), ref_param.detach()), name


NO_DYNAMO = """
import sys, torch
from torchps.ps_server.optimizers import VariableOptimizer
from torchps.ps_server.row_optimizers import ROW_OPTIMIZERS, normalize_row_spec
from torchps.errors import OptimizerSpecError
for name, hyper in {cases!r}:
    ours = VariableOptimizer(name, hyper, torch.zeros(4))
    ours.apply(torch.ones(4))
    ours.load_state_dict(ours.state_dict())
    try:
        VariableOptimizer(name, {{"lr": -1.0}}, torch.zeros(4))
    except OptimizerSpecError as exc:
        assert "Invalid learning rate: -1" in str(exc), exc
    else:
        raise AssertionError("a negative learning rate was taken")
for name in ROW_OPTIMIZERS:
    normalize_row_spec(name, {{"lr": 0.5}})
print("torch._dynamo" in sys.modules)
"""


def test_a_shards_optimizers_never_import_torch_dynamo():
    """Making, stepping, saving and loading every optimizer, and checking specs, imports no torch._dynamo (what
    torch.optim's classes import: over a second of CPU in every shard process)."""
    result = subprocess.run([sys.executable, "-c", NO_DYNAMO.format(cases=CASES)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
