"""EmbeddingTable: sharded fixed-size and dynamic tables train like one nn.Embedding(sparse=True) under
torch.optim; deterministic rows, admission, eviction, memory accounting, checkpoints and relayout."""

import numpy as np
import pytest
import torch

from torchps.errors import InvalidArgumentError, NonFiniteGradientError, OptimizerSpecError, TensorMismatchError
from torchps.ps_server.embeddings import EmbeddingTable, initial_rows, relayout, shard_of
from torchps.ps_server.row_optimizers import RowOptimizer, coalesce

# torch.optim.Adagrad (the reference) builds sparse tensors without saying whether to check them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
DIM = 5
HYPER = {"sgd": {"lr": 0.1}, "adagrad": {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1},
         "sparse_adam": {"lr": 0.01}, "rowwise_adagrad": {"lr": 0.1}}
TORCH = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "sparse_adam": torch.optim.SparseAdam}


def _shards(n, **kwargs):
    return [EmbeddingTable(DIM, shard_index=i, num_shards=n, **kwargs) for i in range(n)]


def _train(shards, ids, grads, step, partition="modulo"):
    """One training step of a sharded table: every shard gets its ids (maybe none), as a client would."""
    owner = shard_of(ids, len(shards), partition)
    for i, shard in enumerate(shards):
        mine = owner == i
        shard.apply(ids[mine], grads[mine], step)


def _rows(shards):
    """{id: (value, {state: row})} over all shards, from their state_dicts."""
    out = {}
    for shard in shards:
        state = shard.state_dict()
        for j, key in enumerate(state["ids"].tolist()):
            out[key] = (state["values"][j], {k: s[j] for k, s in state["state"].items()})
    return out


class _DenseRowwise:
    """Row-wise Adagrad's reference: the row optimizer over one whole tensor (itself checked against a dense
    reference in test_row_optimizers.py)."""

    def __init__(self, weight, hyper):
        self.weight, self.optimizer = weight, RowOptimizer("rowwise_adagrad", hyper)
        self.states = {"sum": torch.zeros(weight.shape[0], 1)}

    def step(self, rows, grads):
        unique, summed = coalesce(rows, grads)
        self.optimizer.step([(self.weight, self.states, unique, summed)])


@pytest.mark.parametrize("optimizer", sorted(HYPER))
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_a_sharded_table_trains_like_one_torch_embedding(optimizer, dynamic):
    gen = torch.Generator().manual_seed(7)
    rows = 40
    # Dynamic tables take any int64 id: row r of the reference is id pool[r].
    pool = torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=gen) if dynamic else torch.arange(rows)
    partition = "hash" if dynamic else "modulo"
    shards = _shards(2, num_embeddings=None if dynamic else rows, partition=partition, optimizer=optimizer,
                     hyperparams=HYPER[optimizer], seed=3)
    weight = torch.empty(rows, DIM)
    owner = shard_of(pool, 2, partition)
    for i, shard in enumerate(shards):
        weight[owner == i] = shard.lookup(pool[owner == i])
    embedding = torch.nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=True)
    if optimizer == "rowwise_adagrad":
        reference = _DenseRowwise(embedding.weight.detach(), HYPER[optimizer])
    else:
        reference = TORCH[optimizer](embedding.parameters(), **HYPER[optimizer])
    for step in range(1, 23):
        size = 0 if step == 5 else int(torch.randint(4, 30, (), generator=gen))
        positions = torch.randint(0, rows, (size,), generator=gen)
        grads = torch.randn(size, DIM, generator=gen)
        if optimizer == "rowwise_adagrad":
            reference.step(positions, grads)
        else:
            reference.zero_grad()
            (embedding(positions) * grads).sum().backward()
            reference.step()
        before = _rows(shards)
        _train(shards, pool[positions], grads, step, partition)
        after = _rows(shards)
        for r, key in enumerate(pool.tolist()):
            torch.testing.assert_close(after[key][0], embedding.weight[r].detach(), rtol=0, atol=1e-6)
            if r not in positions.tolist():  # untouched: bit for bit, state included
                assert torch.equal(after[key][0], before[key][0])
                assert all(torch.equal(after[key][1][k], before[key][1][k]) for k in after[key][1])
        if optimizer in ("adagrad", "sparse_adam"):
            torch_state = reference.state[embedding.weight]
            for r, key in enumerate(pool.tolist()):
                for name, value in after[key][1].items():
                    torch.testing.assert_close(value, torch_state[name][r], rtol=1e-6, atol=1e-6)
            assert {s.optimizer.steps for s in shards} == {int(torch_state["step"])}


def test_rows_start_from_seed_and_id_alone():
    ids = torch.tensor([0, 3, 17, 2 ** 40, -5, 2 ** 63 - 1])
    one = EmbeddingTable(DIM, seed=11)
    hashed = _shards(3, seed=11, partition="hash")
    later = EmbeddingTable(DIM, seed=11)  # a restart: a new table, nothing carried over
    expected = initial_rows(ids.numpy(), DIM, seed=11)
    assert torch.equal(one.lookup(ids), expected)
    owner = shard_of(ids, 3, "hash")
    for i, shard in enumerate(hashed):
        assert torch.equal(shard.lookup(ids[owner == i]), expected[owner == i])
    assert torch.equal(later.lookup(ids.flip(0)), expected.flip(0))
    fixed = EmbeddingTable(DIM, num_embeddings=20, shard_index=1, num_shards=2, seed=11)
    assert torch.equal(fixed.lookup(torch.tensor([3, 17])), expected[1:3])
    assert not torch.equal(EmbeddingTable(DIM, seed=12).lookup(ids), expected)
    many = initial_rows(np.arange(20000), 10, seed=1)
    assert abs(many.mean()) < 0.01 and abs(many.std() - 1) < 0.01
    uniform = initial_rows(np.arange(20000), 10, init="uniform", init_scale=0.5, dtype=torch.float64)
    assert uniform.dtype == torch.float64 and -0.5 <= uniform.min() and uniform.max() < 0.5
    assert abs(uniform.std() - 0.5 / 3 ** 0.5) < 0.005


def test_an_id_is_admitted_at_its_min_count_th_lookup():
    table = EmbeddingTable(DIM, optimizer="adagrad", min_count=3)
    ids, other = torch.tensor([8, 9]), torch.tensor([9])
    zeros = torch.zeros(2, DIM)
    assert torch.equal(table.lookup(ids), zeros)
    assert torch.equal(table.lookup(ids, admit=False), zeros)  # not counted
    assert table.apply(ids, torch.ones(2, DIM), 1) == 0  # nothing stored to update
    assert table.counters()["rows"] == 0 and table.counters()["pending"] == 2
    assert torch.equal(table.lookup(other), torch.zeros(1, DIM))
    assert torch.equal(table.lookup(ids), torch.cat([zeros[:1], initial_rows(np.array([9]), DIM)]))
    counters = table.counters()
    assert (counters["rows"], counters["pending"], counters["admitted"], counters["optimizer_steps"]) == (1, 1, 1, 1)
    assert table.apply(torch.tensor([9, 8, 9]), torch.ones(3, DIM), 2) == 1
    assert torch.equal(table.lookup(ids)[0], initial_rows(np.array([8]), DIM)[0])  # 8's third lookup


def test_eviction_by_age_keeps_survivors_and_their_state_across_slabs():
    table = EmbeddingTable(DIM, optimizer="sparse_adam", max_age=3)
    ids = torch.arange(5000) * 3 - 7000  # several slabs
    table.lookup(ids)  # created at step 0
    recent = ids[torch.randperm(5000, generator=torch.Generator().manual_seed(0))[:1500]]
    table.apply(recent, torch.randn(1500, DIM), 5)
    before, big = _rows([table]), table.nbytes()
    assert table.evict(3) == {"by_age": 0, "by_capacity": 0}
    assert table.evict(4) == {"by_age": 3500, "by_capacity": 0}
    after = _rows([table])
    assert sorted(after) == sorted(recent.tolist())
    for key, (value, state) in after.items():
        assert torch.equal(value, before[key][0]) and all(torch.equal(state[k], before[key][1][k]) for k in state)
    counters = table.counters()
    assert (counters["rows"], counters["evicted_by_age"], counters["evicted"]) == (1500, 3500, 3500)
    assert counters["bytes"] < big / 2  # slabs given back
    assert torch.equal(table.lookup(ids[:1], admit=False), torch.zeros(1, DIM))  # evicted: gone
    assert torch.equal(table.lookup(ids[:1]), initial_rows(ids[:1].numpy(), DIM))  # re-created afresh


def test_eviction_by_capacity_drops_the_least_recently_updated_and_stale_counters():
    table = EmbeddingTable(DIM, capacity=100, max_age=50, min_count=2)
    table.lookup(torch.arange(300))
    table.lookup(torch.arange(300))
    for step in range(1, 31):  # ids 10*(step-1) .. 10*step-1 last updated at `step`
        table.apply(torch.arange(10 * (step - 1), 10 * step), torch.ones(10, DIM), step)
    table.lookup(torch.arange(1000, 1300))  # counted once, seen at step 30
    assert table.counters()["pending"] == 300
    assert table.evict(30) == {"by_age": 0, "by_capacity": 200}
    assert sorted(_rows([table])) == list(range(200, 300))
    counters = table.counters()
    assert (counters["rows"], counters["evicted_by_capacity"], counters["pending"]) == (100, 200, 100)
    assert table.evict(81) == {"by_age": 100, "by_capacity": 0}  # rows last updated at 30 and before
    assert (table.counters()["rows"], table.counters()["pending"]) == (0, 0)


def _reachable_bytes(root):
    """Bytes of every tensor storage and numpy buffer reachable from `root` through torchps objects."""
    seen, buffers, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            buffers[("t", obj.untyped_storage().data_ptr())] = obj.untyped_storage().nbytes()
        elif isinstance(obj, np.ndarray):
            while isinstance(obj.base, np.ndarray):
                obj = obj.base
            buffers[("n", id(obj))] = obj.nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("torchps"):
            stack.append(vars(obj))
    return sum(buffers.values())


def test_bytes_per_row_stay_within_1_3_times_row_and_optimizer_state():
    table = EmbeddingTable(32, optimizer="adagrad", hyperparams={"lr": 0.1})
    assert table.row_bytes == (32 + 32) * 4
    seen = []
    for start in range(0, 100_000, 10_000):
        table.lookup(torch.arange(start, start + 10_000) * 977 - 10 ** 9)
        counters = table.counters()
        assert counters["bytes"] == table.nbytes() == _reachable_bytes(table)
        seen.append(counters["bytes"] / (counters["rows"] * counters["row_bytes"]))
    table.apply(torch.arange(0, 100_000, 2) * 977 - 10 ** 9, torch.ones(50_000, 32), 1)
    assert table.evict(1000) == {"by_age": 0, "by_capacity": 0}  # no max_age, no capacity
    halved = EmbeddingTable(32, optimizer="adagrad", max_age=0)  # the same table, but its own policy
    halved.load_state_dict(table.state_dict())
    assert halved.evict(1) == {"by_age": 50_000, "by_capacity": 0}
    seen.append(halved.nbytes() / (50_000 * halved.row_bytes))
    assert halved.nbytes() == _reachable_bytes(halved)
    assert max(seen) <= 1.3, seen


def _equal_states(a, b):
    assert a.keys() == b.keys()
    for key in a.keys() - {"changes"}:  # the change log's cursor names the table object it was copied from
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif isinstance(a[key], dict):
            _equal_states(a[key], b[key])
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("kwargs", [dict(num_embeddings=30, shard_index=1, num_shards=2, partition="hash"),
                                    dict(min_count=2, max_age=10)], ids=["fixed", "dynamic"])
def test_state_dict_round_trip_and_training_goes_on_alike(kwargs):
    table = EmbeddingTable(DIM, optimizer="sparse_adam", seed=4, **kwargs)
    ids = shard_of(torch.arange(30), 2, "hash") == 1 if "num_embeddings" in kwargs else torch.ones(30, dtype=bool)
    ids = torch.arange(30)[ids]
    table.lookup(ids)
    table.lookup(ids[::2])
    table.lookup(ids[::3])
    table.apply(ids[:7], torch.randn(7, DIM), 3)
    saved = table.state_dict()
    copy = EmbeddingTable.from_state_dict(saved)
    _equal_states(copy.state_dict(), saved)
    assert {**copy.counters(), "bytes": 0} == {**table.counters(), "bytes": 0}
    grads = torch.randn(len(ids), DIM)
    for one in (table, copy):
        one.lookup(ids)
        one.apply(ids, grads, 4)
    _equal_states(copy.state_dict(), table.state_dict())
    with pytest.raises(InvalidArgumentError):
        EmbeddingTable(DIM + 1, optimizer="sparse_adam", seed=4, **kwargs).load_state_dict(saved)
    with pytest.raises(InvalidArgumentError):
        copy.load_state_dict({**saved, "values": saved["values"][1:]})
    _equal_states(copy.state_dict(), table.state_dict())  # a refused load changed nothing


@pytest.mark.parametrize("fixed", [False, True], ids=["dynamic", "fixed"])
def test_relayout_two_shards_into_three_keeps_every_row_and_its_state(fixed):
    settings = dict(num_embeddings=50 if fixed else None, optimizer="adagrad", min_count=1 if fixed else 2)
    old = _shards(2, **settings)
    pool = torch.arange(50) if fixed else torch.arange(50) * 1_000_003 - 7
    owner = shard_of(pool, 2)
    for _ in range(2):
        for i, shard in enumerate(old):
            shard.lookup(pool[owner == i][: 20])  # ids 40.. only counted once: pending
    for step in range(1, 4):
        _train(old, pool[:30], torch.randn(30, DIM), step)
    states = [s.state_dict() for s in reversed(old)]
    new = [EmbeddingTable.from_state_dict(relayout(states, i, 3, partition="hash")) for i in range(3)]
    assert _rows(new).keys() == _rows(old).keys()
    for key, (value, state) in _rows(new).items():
        assert torch.equal(value, _rows(old)[key][0]) and torch.equal(state["sum"], _rows(old)[key][1]["sum"])
        assert new[int(shard_of(torch.tensor([key]), 3, "hash"))].lookup(torch.tensor([key]), admit=False).any()
    assert sum(s.counters()["rows"] for s in new) == sum(s.counters()["rows"] for s in old)
    assert sum(s.counters()["pending"] for s in new) == sum(s.counters()["pending"] for s in old)
    assert {s.optimizer.steps for s in new} == {3}
    if not fixed:
        ages = {k: v for s in old for k, v in zip(s.state_dict()["ids"].tolist(), s.state_dict()["last_update"])}
        for shard in new:
            state = shard.state_dict()
            assert all(ages[k] == v for k, v in zip(state["ids"].tolist(), state["last_update"]))
    with pytest.raises(InvalidArgumentError):
        relayout(states[:1], 0, 3)
    # An async job's shards count different steps (a push that reached one and failed on the other): the highest
    assert relayout([states[0], {**states[1], "optimizer_steps": 2}], 0, 3)["optimizer_steps"] == 3


def test_bad_calls_are_refused_and_change_nothing():
    table = EmbeddingTable(DIM, num_embeddings=10, shard_index=0, num_shards=2, optimizer="adagrad")
    saved = table.state_dict()
    for call in [lambda: table.lookup(torch.tensor([0.0])), lambda: table.lookup(torch.tensor([[0]])),
                 lambda: table.lookup(torch.tensor([2, 2])), lambda: table.lookup(torch.tensor([1])),
                 lambda: table.lookup(torch.tensor([12])),
                 lambda: table.apply(torch.tensor([2]), torch.ones(1, DIM), -1),
                 lambda: table.apply(torch.tensor([3]), torch.ones(1, DIM), 1)]:
        with pytest.raises(InvalidArgumentError):
            call()
    for grads in (torch.ones(2, DIM), torch.ones(1, DIM + 1), torch.ones(1, DIM, dtype=torch.float64)):
        with pytest.raises(TensorMismatchError):
            table.apply(torch.tensor([2]), grads, 1)
    with pytest.raises(NonFiniteGradientError):
        table.apply(torch.tensor([2, 4]), torch.tensor([[1.0] * DIM, [float("inf")] * DIM]), 1)
    _equal_states(table.state_dict(), saved)
    for settings in [dict(num_embeddings=10, capacity=5), dict(num_embeddings=10, min_count=2), dict(dim=0),
                     dict(shard_index=2, num_shards=2), dict(partition="range"), dict(init="xavier"),
                     dict(dtype=torch.int64), dict(max_age=-1)]:
        with pytest.raises(InvalidArgumentError):
            EmbeddingTable(**{"dim": DIM, **settings})
    with pytest.raises(OptimizerSpecError):
        EmbeddingTable(DIM, optimizer="sgd", hyperparams={"momentum": 0.9})
