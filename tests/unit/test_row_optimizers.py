"""Lazy row optimizers match torch.optim on nn.Embedding(sparse=True) gradients (row-wise Adagrad: a dense
reference) to 1e-6, step by step, with repeated ids in batches, and never write a row a step does not name."""

import inspect

import pytest
import torch

from torchps.errors import InvalidArgumentError, OptimizerSpecError, TensorMismatchError
from torchps.ps_server.row_optimizers import ROW_OPTIMIZERS, RowOptimizer, coalesce, normalize_row_spec

# torch.optim.Adagrad (the reference) builds sparse tensors without saying whether to check them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
ROWS, DIM, STEPS = 50, 6, 25
TORCH = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "sparse_adam": torch.optim.SparseAdam}
STATE_NAMES = {"sgd": (), "adagrad": ("sum",), "sparse_adam": ("exp_avg", "exp_avg_sq")}
CASES = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.05, "maximize": 1.0}),
    ("adagrad", {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-10}),
    ("adagrad", {"lr": 0.1, "maximize": 1.0}),
    ("sparse_adam", {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-8}),
    ("sparse_adam", {"lr": 0.01, "maximize": 1.0}),
]


def _batches(seed, empty_at=7):
    """STEPS batches of ids with repeats (about a third of the rows each; step `empty_at` names none) and the
    weights of a loss sum(weights * embedding(ids)), whose gradient is `weights` row by row."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(STEPS):
        size = 0 if step == empty_at else int(torch.randint(5, 25, (), generator=gen))
        ids = torch.randint(0, ROWS, (size,), generator=gen)
        if size:
            ids[-1] = ids[0]  # always a repeat
        out.append((ids, torch.randn(size, DIM, generator=gen)))
    return out


def _fresh_states(optimizer, values):
    return {k: torch.full((values.shape[0], w), init, dtype=values.dtype)
            for k, (w, init) in optimizer.state_spec(values.shape[1]).items()}


def _step_checking_untouched(optimizer, values, states, ids, weights):
    """One lazy step; asserts rows the batch does not name kept their value and state bit for bit."""
    before = values.clone(), {k: s.clone() for k, s in states.items()}
    unique, grads = coalesce(ids, weights)
    optimizer.step([(values, states, unique, grads)])
    untouched = torch.ones(values.shape[0], dtype=torch.bool)
    untouched[unique] = False
    assert torch.equal(values[untouched], before[0][untouched])
    for key, state in states.items():
        assert torch.equal(state[untouched], before[1][key][untouched]), key


@pytest.mark.parametrize("name,hyper", CASES)
def test_matches_torch_optim_on_sparse_embedding_gradients(name, hyper):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(ROWS, DIM, sparse=True)
    values = embedding.weight.detach().clone()
    kwargs = {k: v for k, v in hyper.items() if k not in ("beta1", "beta2", "maximize")}
    if "beta1" in hyper:
        kwargs["betas"] = (hyper["beta1"], hyper["beta2"])
    reference = TORCH[name](embedding.parameters(), maximize=bool(hyper.get("maximize", 0)), **kwargs)
    ours = RowOptimizer(name, hyper)
    states = _fresh_states(ours, values)
    for ids, weights in _batches(1):
        reference.zero_grad()
        (embedding(ids) * weights).sum().backward()
        reference.step()
        _step_checking_untouched(ours, values, states, ids, weights)
        torch.testing.assert_close(values, embedding.weight.detach(), rtol=0, atol=1e-6)
        torch_state = reference.state[embedding.weight]
        for key in STATE_NAMES[name]:
            torch.testing.assert_close(states[key], torch_state[key], rtol=1e-6, atol=1e-6)
        if name != "sgd":
            assert ours.steps == int(torch_state["step"])  # one count per table, empty steps included


def test_rowwise_adagrad_matches_a_dense_reference():
    hyper = {"lr": 0.1, "eps": 1e-8, "initial_accumulator_value": 0.01}
    torch.manual_seed(0)
    start = torch.randn(ROWS, DIM)
    values, ours = start.clone(), RowOptimizer("rowwise_adagrad", hyper)
    states = _fresh_states(ours, values)
    assert states["sum"].shape == (ROWS, 1)
    ref_values, ref_sum = start.double(), torch.full((ROWS,), 0.01, dtype=torch.float64)
    for ids, weights in _batches(2):
        grads = torch.zeros(ROWS, DIM, dtype=torch.float64).index_add_(0, ids, weights.double())
        for row in ids.unique().tolist():
            g = grads[row]
            ref_sum[row] += (g * g).mean()
            ref_values[row] -= 0.1 * g / (ref_sum[row].sqrt() + 1e-8)
        _step_checking_untouched(ours, values, states, ids, weights)
        torch.testing.assert_close(values.double(), ref_values, rtol=0, atol=1e-6)
        torch.testing.assert_close(states["sum"][:, 0].double(), ref_sum, rtol=1e-6, atol=1e-6)


def test_parts_of_a_table_step_together_and_the_state_dict_round_trips():
    torch.manual_seed(3)
    whole, halves = torch.randn(10, 4), None
    one, two = RowOptimizer("sparse_adam", {"lr": 0.1}), RowOptimizer("sparse_adam", {"lr": 0.1})
    whole_states = _fresh_states(one, whole)
    halves = [whole[:5].clone(), whole[5:].clone()]
    half_states = [_fresh_states(two, h) for h in halves]
    for _ in range(3):
        ids, grads = torch.tensor([1, 4, 6, 9]), torch.randn(4, 4)
        one.step([(whole, whole_states, ids, grads)])
        two.step([(halves[0], half_states[0], ids[:2], grads[:2]), (halves[1], half_states[1], ids[2:] - 5, grads[2:])])
    assert torch.equal(torch.cat(halves), whole)
    assert RowOptimizer.from_state_dict(two.state_dict()).state_dict() == {
        "name": "sparse_adam", "hyperparams": two.hyperparams, "steps": 3}


def test_coalesce_sums_repeats_in_id_order():
    ids, grads = coalesce(torch.tensor([5, 2, 5, 7]), torch.tensor([[1.0], [2.0], [3.0], [4.0]]))
    assert ids.tolist() == [2, 5, 7] and grads[:, 0].tolist() == [2.0, 4.0, 4.0]
    ids, grads = coalesce(torch.tensor([9, 3]), torch.tensor([[1.0], [2.0]]))
    assert ids.tolist() == [3, 9] and grads[:, 0].tolist() == [2.0, 1.0]
    with pytest.raises(InvalidArgumentError):
        coalesce(torch.tensor([1.0]), torch.zeros(1, 1))
    with pytest.raises(TensorMismatchError):
        coalesce(torch.tensor([1, 2]), torch.zeros(3, 1))


def test_defaults_are_torch_optims_and_what_cannot_be_lazy_is_refused():
    for name, (cls, defaults) in ROW_OPTIMIZERS.items():
        if cls is None:
            continue
        params = inspect.signature(cls).parameters
        theirs = {k: float(p.default) for k, p in params.items() if isinstance(p.default, (int, float, bool))}
        if "betas" in params:
            theirs["beta1"], theirs["beta2"] = params["betas"].default
        assert {k: theirs[k] for k in defaults} == defaults, name
    assert normalize_row_spec("AdaGrad", {"lr": 1})[1]["eps"] == 1e-10
    for name, hyper in [("sgd", {"momentum": 0.9}), ("sgd", {"weight_decay": 0.1}), ("adagrad", {"weight_decay": 1}),
                        ("adam", {}), ("sgd", {"lr": -1.0}), ("sparse_adam", {"beta1": 1.0}),
                        ("rowwise_adagrad", {"eps": 0.0}), ("sgd", {"maximize": 2.0}), ("sgd", {"lr": float("nan")}),
                        ("rowwise_adagrad", {"lr_decay": 0.1})]:
        with pytest.raises(OptimizerSpecError):
            normalize_row_spec(name, hyper)
