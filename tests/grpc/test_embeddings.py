"""Embedding tables served by real shards: torchps.client's Embedding and EmbeddingBag against torch's.

Forward equals torch's modules holding the same rows, bit for bit; a model
trained async (and ssp) with one worker ends with the rows torch's
EmbeddingBag(sparse=True) and torch.optim reach on the same batches; only a
batch's distinct ids travel; dynamic tables admit at min_count and evict by
age and capacity, counted in GetStatus; bad input is refused with its status
code and changes nothing. Ordering is by events (replies, counters), never by
sleeping.
"""

from __future__ import annotations

import struct
import threading

import grpc
import pytest
import torch
from helpers import wait_until
from torch import nn

from torchps import rows
from torchps.client import (Embedding, EmbeddingBag, InvalidArgumentError, NonFiniteGradientError, Optimizer,
                            PSClient, SpecConflictError, TaskSpec)
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server.embeddings import initial_rows

# torch.optim.Adagrad (the reference) builds sparse tensors without saying whether to check them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
N, D = 30, 4
TIMEOUT = 30.0


def _bind(client: PSClient, module: nn.Module, prefix: str, optimizer: Optimizer | None = None):
    return client.register_module(module, optimizer or Optimizer("sgd", lr=0.5), create=True, prefix=prefix)


def _table(client: PSClient, name: str, ids: torch.Tensor) -> torch.Tensor:
    """The rows of `ids` as the shards hold them now (read without admitting)."""
    return client.lookup_rows({name: ids}, admit=False)[name]


def _status(client: PSClient, name: str) -> list[ps_pb2.TableStatus]:
    """Each shard's counters of table `name`, by shard."""
    return [next(t for t in client.status(s).tables if t.name == name) for s in range(client.cluster.num_ps)]


def _torch_twin(module, weight: torch.Tensor):
    """torch's module of the same kind and settings, holding `weight` (its padding row zeroed, as torch's is)."""
    weight = weight.clone()
    if module.padding_idx is not None:
        weight[module.padding_idx] = 0
    if isinstance(module, EmbeddingBag):
        sparse = module.mode != "max" and not module.scale_grad_by_freq
        return nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode=module.mode, sparse=sparse,
                                               include_last_offset=module.include_last_offset,
                                               padding_idx=module.padding_idx,
                                               scale_grad_by_freq=module.scale_grad_by_freq)
    return nn.Embedding.from_pretrained(weight, freeze=False, sparse=not module.scale_grad_by_freq,
                                        padding_idx=module.padding_idx,
                                        scale_grad_by_freq=module.scale_grad_by_freq)


def _coalesced(ids: torch.Tensor, grads: torch.Tensor) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for key, row in zip(ids.tolist(), grads):
        out[key] = out[key] + row if key in out else row
    return out


CASES = {
    "embedding-padding": (lambda: Embedding(N, D, padding_idx=-1, partition="hash"),
                          lambda g: (torch.randint(0, N, (5, 7), generator=g),)),
    "embedding-freq": (lambda: Embedding(N, D, scale_grad_by_freq=True),
                       lambda g: (torch.randint(0, 6, (40,), generator=g),)),
    "bag-sum-2d": (lambda: EmbeddingBag(N, D, mode="sum", padding_idx=3),
                   lambda g: (torch.randint(0, N, (6, 5), generator=g),)),
    "bag-mean-offsets": (lambda: EmbeddingBag(N, D, mode="mean", padding_idx=0),
                         lambda g: (torch.cat([torch.zeros(3, dtype=torch.long),  # a bag of padding only
                                               torch.randint(0, N, (17,), generator=g)]),
                                    torch.tensor([0, 3, 3, 9, 15]))),
    "bag-max-last-offset": (lambda: EmbeddingBag(N, D, mode="max", include_last_offset=True, partition="hash"),
                            lambda g: (torch.randint(0, N, (20,), generator=g), torch.tensor([0, 4, 11, 20]))),
    "bag-sum-weights": (lambda: EmbeddingBag(N, D, mode="sum"),
                        lambda g: (torch.randint(0, N, (12,), generator=g), torch.tensor([0, 5, 5, 8]),
                                   torch.rand(12, generator=g))),
    "bag-sum-int32": (lambda: EmbeddingBag(N, D, mode="sum", dtype=torch.float64),
                      lambda g: (torch.randint(0, N, (4, 3), generator=g, dtype=torch.int32),)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_row_gradients_equal_torchs(client, case):
    make, batch = CASES[case]
    module = make()
    _bind(client, module, f"forward/{case}/")
    weight = _table(client, module.table_name, torch.arange(N))
    twin = _torch_twin(module, weight)
    gen = torch.Generator().manual_seed(len(case))
    for _ in range(3):
        inputs = batch(gen)
        ours, theirs = module(*inputs), twin(*inputs)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), case
        scale = torch.randn(theirs.shape, generator=gen, dtype=theirs.dtype)
        twin.weight.grad = None
        (ours * scale).sum().backward()
        (theirs * scale).sum().backward()
        ids, grads = module.take_gradients()
        got = _coalesced(ids, grads)
        grad = twin.weight.grad
        if grad.is_sparse:
            grad = grad.coalesce()
            expected = dict(zip(grad.indices()[0].tolist(), grad.values()))
        else:  # max mode, scale_grad_by_freq: torch's gradient is dense; the module sends the batch's rows
            # but padding's
            expected = {i: grad[i] for i in torch.unique(inputs[0]).tolist() if i != module.padding_idx}
        assert sorted(got) == sorted(expected), case
        for key, row in expected.items():
            torch.testing.assert_close(got[key], row, rtol=0, atol=0)
    assert module.take_gradients() is None


class _Model(nn.Module):
    def __init__(self, bag: nn.Module):
        super().__init__()
        self.bag, self.head = bag, nn.Linear(D, 1)
        with torch.no_grad():  # the same start every run: training stays tame, differences stay rounding
            self.head.weight.copy_(torch.linspace(-0.3, 0.3, D)[None])
            self.head.bias.fill_(0.1)

    def forward(self, ids, offsets, weights=None):
        return self.head(self.bag(ids, offsets, weights))


TRAINING = {
    "sgd": (Optimizer("sgd", lr=0.2), lambda p: torch.optim.SGD(p, lr=0.2)),
    "adagrad": (Optimizer("adagrad", lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
                lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    "sparse_adam": (Optimizer("sparse_adam", lr=0.01, betas=(0.8, 0.99)),
                    lambda p: torch.optim.SparseAdam(p, lr=0.01, betas=(0.8, 0.99))),
}


def _batches(steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 12, (24,), generator=gen)  # repeats, the padding id 0 among them
        offsets = torch.tensor([0, 5, 9, 9, 16])
        yield ids, offsets, torch.randn(5, 1, generator=gen)


def _train_and_compare(client: PSClient, prefix: str, optimizer: str, mode: str, exchange: bool) -> None:
    ours_opt, torch_opt = TRAINING[optimizer]
    bag = EmbeddingBag(N, D, mode=mode, padding_idx=0, optimizer=ours_opt, partition="hash")
    model = _Model(bag)
    binding = client.register_module(model, Optimizer("sgd", lr=0.1), create=True, prefix=prefix)
    start = _table(client, bag.table_name, torch.arange(N))
    reference = _Model(_torch_twin(bag, start))
    optimizers = [torch_opt(reference.bag.parameters()), torch.optim.SGD(reference.head.parameters(), lr=0.1)]
    for ids, offsets, target in _batches(6, seed=len(prefix)):
        model.zero_grad()
        ((model(ids, offsets) - target) ** 2).mean().backward()
        binding.exchange() if exchange else (binding.push(), binding.pull())
        for opt in optimizers:
            opt.zero_grad()
        ((reference(ids, offsets) - target) ** 2).mean().backward()
        # Summed repeats, as the worker sends them (Adagrad and SparseAdam coalesce it themselves; SGD would
        # add the repeated rows one at a time, rounding differently).
        reference.bag.weight.grad = reference.bag.weight.grad.coalesce()
        for opt in optimizers:
            opt.step()
    after = _table(client, bag.table_name, torch.arange(N))
    assert torch.equal(after[1:], reference.bag.weight.detach()[1:])  # bit for bit
    assert torch.equal(after[0], start[0])  # the padding row: never sent, never updated
    assert torch.equal(model.head.weight.detach(), reference.head.weight.detach())
    statuses = _status(client, bag.table_name)
    assert [s.optimizer_steps for s in statuses] == [6, 6]  # every push reached every shard, rows or not


@pytest.mark.parametrize("optimizer", sorted(TRAINING))
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_async_training_ends_with_torchs_rows(client, optimizer, mode):
    _train_and_compare(client, f"train/{optimizer}/{mode}/", optimizer, mode, exchange=optimizer != "sgd")


def test_ssp_training_ends_with_torchs_rows(local_cluster):
    local = local_cluster(2)
    with PSClient(local.cluster, connect_timeout=10.0) as client:
        client.configure("ssp", max_staleness=1, total_num_replicas=1)
        _train_and_compare(client, "ssp/", "adagrad", "sum", exchange=True)


def test_only_the_batchs_distinct_ids_travel(client):
    bag = EmbeddingBag(1000, D, mode="sum", padding_idx=999)
    _bind(client, nn.ModuleDict({"bag": bag}), "distinct/")
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 999] * 50)  # 400 ids, 7 distinct rows and the padding id
    before = [client.status(s) for s in range(2)]
    bag(ids, torch.arange(0, 400, 8)).sum().backward()
    client.push({}, rows={bag.table_name: bag.take_gradients()})
    after = [client.status(s) for s in range(2)]
    statuses = _status(client, bag.table_name)
    assert sum(s.rows_read for s in statuses) == 7  # looked up: the distinct ids but padding's
    assert sum(s.rows_pushed for s in statuses) == 7
    pushed = sum(a.push_bytes_received - b.push_bytes_received for a, b in zip(after, before))
    assert pushed == 7 * (8 + 4 * D)  # ids and rows only: the table never travels


def test_a_dynamic_table_admits_at_min_count_and_stores_nothing_before(client):
    emb = Embedding(None, D, min_count=2, optimizer=Optimizer("sgd", lr=1.0))
    _bind(client, nn.ModuleDict({"emb": emb}), "admit/")
    ids = torch.tensor([10, 11, -3, 2 ** 40])
    first = emb(ids)
    assert torch.equal(first, torch.zeros(4, D))
    first.sum().backward()
    client.push({}, rows={emb.table_name: emb.take_gradients()})  # no rows yet: nothing to update
    counters = _status(client, emb.table_name)
    assert [(s.rows, s.pending, s.admitted) for s in counters] == [(0, 2, 0), (0, 2, 0)]
    seed = client.table_layout(emb.table_name).spec.init.seed
    assert torch.equal(emb(ids), initial_rows(ids.numpy(), D, seed=seed))  # the second lookup creates them
    counters = _status(client, emb.table_name)
    assert [(s.rows, s.pending, s.admitted) for s in counters] == [(2, 0, 2), (2, 0, 2)]
    with torch.no_grad():
        emb.eval()
        assert torch.equal(emb(torch.tensor([12, 13])), torch.zeros(2, D))  # evaluation: read only
    assert [s.pending for s in _status(client, emb.table_name)] == [0, 0]


def _step(client: PSClient, emb: Embedding, ids: torch.Tensor) -> None:
    emb(ids).sum().backward()
    client.push({}, rows={emb.table_name: emb.take_gradients()})


def test_dynamic_tables_evict_by_age_and_by_capacity(client):
    aging = Embedding(None, D, max_age=1, optimizer=Optimizer("sgd", lr=0.1))
    capped = Embedding(None, D, capacity=1, optimizer=Optimizer("sgd", lr=0.1))
    _bind(client, nn.ModuleDict({"aging": aging, "capped": capped}), "evict/")
    _step(client, aging, torch.tensor([0, 1]))  # both updated at this push's step
    _step(client, aging, torch.tensor([2, 3]))  # 0 and 1: one step old, kept
    assert [(s.rows, s.evicted) for s in _status(client, aging.table_name)] == [(2, 0), (2, 0)]
    _step(client, aging, torch.tensor([2, 3]))  # 0 and 1: two steps old, evicted
    assert [(s.rows, s.evicted_by_age, s.evicted) for s in _status(client, aging.table_name)] == [(1, 1, 1), (1, 1, 1)]
    _step(client, capped, torch.tensor([0, 2, 4, 1]))  # shard 0 gets three rows, keeps one
    counters = _status(client, capped.table_name)
    assert [(s.rows, s.evicted_by_capacity, s.admitted) for s in counters] == [(1, 2, 3), (1, 0, 1)]
    assert "evicted" in client.placement_report() and capped.table_name in client.placement_report()


def test_a_worker_waits_for_the_chiefs_tables_then_trains_them(shared_cluster, client):
    bound = {}

    def worker_registers(worker: PSClient) -> None:
        model = nn.ModuleDict({"emb": Embedding(N, D, optimizer=Optimizer("sgd", lr=1.0))})
        bound["binding"] = worker.register_module(model, create=False, prefix="wait/", wait_timeout=TIMEOUT)
        bound["emb"] = model["emb"]

    with PSClient(shared_cluster.cluster, task=TaskSpec("worker", 1), connect_timeout=10.0) as worker:
        thread = threading.Thread(target=worker_registers, args=(worker,))
        thread.start()
        wait_until(lambda: all(client.status(s).waiting_calls for s in range(2)), TIMEOUT,
                   "the worker waiting for the table on both shards")
        chief = Embedding(N, D, optimizer=Optimizer("sgd", lr=1.0))
        client.register_module(nn.ModuleDict({"emb": chief}), create=True, prefix="wait/", join=False)
        thread.join(TIMEOUT)
        emb, binding = bound["emb"], bound["binding"]
        ids = torch.tensor([1, 2, 2])
        before = chief(ids).detach()
        assert torch.equal(emb(ids), before)
        emb(ids).sum().backward()
        binding.push()
        assert torch.equal(chief(ids).detach(), before - torch.tensor([[1.0], [2.0], [2.0]]))


def test_tables_are_created_in_sync_mode(local_cluster):
    local = local_cluster(1)
    with PSClient(local.cluster, connect_timeout=10.0) as client:
        client.configure("sync", total_num_replicas=1)
        _bind(client, nn.ModuleDict({"emb": Embedding(N, D)}), "sync/")  # no longer refused
        assert [t.name for t in client.status(0).tables] == ["sync/emb.weight"]


def test_a_fixed_size_table_exports_into_torchs_embedding_bag(shared_cluster, client):
    """export_state_dict gives a fixed-size table as its whole (N, dim) weight (padding row zeroed, as torch's),
    which nn.EmbeddingBag and nn.Embedding load; dynamic tables are left out, and refused when named.
    (Checkpoints of tables: tests/integration/test_table_checkpoints.py.)"""
    model = nn.ModuleDict({"bag": EmbeddingBag(N, D, mode="sum", padding_idx=7, partition="hash",
                                               optimizer=Optimizer("adagrad", lr=0.3)),
                           "ids": EmbeddingBag(None, D, mode="sum", optimizer=Optimizer("sgd", lr=0.1)),
                           "head": nn.Linear(D, 1)})
    binding = _bind(client, model, "export/")
    model["bag"](torch.tensor([1, 7, 7, 29, 3, 1]), torch.tensor([0, 3, 5])).sum().backward()
    binding.push()

    exported = client.export_state_dict(binding.names + ["export/bag.weight"], strip_prefix="export/")
    assert sorted(exported) == ["bag.weight", "head.bias", "head.weight"]
    everything = client.export_state_dict()
    assert "export/bag.weight" in everything and "export/ids.weight" not in everything, "dynamic: left out"
    with pytest.raises(InvalidArgumentError, match=r"\['export/ids.weight'\] are dynamic embedding tables"):
        client.export_state_dict(["export/ids.weight"])

    torch_bag = nn.EmbeddingBag(N, D, mode="sum", padding_idx=7)
    torch_bag.load_state_dict({"weight": exported["bag.weight"]})
    held = _table(client, "export/bag.weight", torch.arange(N))
    kept = torch.arange(N) != 7
    assert torch.equal(torch_bag.weight.detach()[kept], held[kept]) and not torch_bag.weight.detach()[7].any()
    probe, offsets = torch.randint(0, N, (40,), generator=torch.Generator().manual_seed(0)), torch.tensor([0, 9, 20])
    with torch.no_grad():
        assert torch.equal(torch_bag(probe, offsets), model["bag"](probe, offsets)), \
            "torch's module with the exported weight computes what the table on the shards does"
        plain = nn.Embedding(N, D, padding_idx=7)
        plain.load_state_dict(client.export_state_dict(["export/bag.weight"], strip_prefix="export/bag."))
        assert torch.equal(plain(probe), nn.functional.embedding(probe, exported["bag.weight"]))
    with PSClient(shared_cluster.cluster, connect_timeout=10.0) as other:  # knows no table: asks the shards
        alone = other.export_state_dict(["export/bag.weight"])["export/bag.weight"]
    assert torch.equal(alone[kept], held[kept])


def test_rows_pushed_in_sync_mode_are_applied_with_the_step(local_cluster):
    local = local_cluster(1)
    with PSClient(local.cluster, connect_timeout=10.0) as client:
        emb = Embedding(N, D)
        client.create_tables([emb.table_spec("t", Optimizer("sgd", lr=1.0))])
        emb.bind(client, "t")
        client.create_variables({"w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        client.configure("sync", total_num_replicas=1)  # no worker joined yet: the mode may change
        client.join()
        emb(torch.tensor([1, 2])).sum().backward()
        before = _table(client, "t", torch.arange(N))
        assert client.push({"w": torch.ones(2)}, rows={"t": emb.take_gradients()}) == 1  # released once applied
        expected = before.clone()
        expected[1:3] -= 1.0  # lr 1, R = N = 1: the worker's own gradient
        assert torch.equal(_table(client, "t", torch.arange(N)), expected)
        assert torch.equal(client.pull(["w"])["w"], -torch.ones(2)) and client.status(0).step == 1


def test_a_table_with_another_spec_or_a_variables_name_is_refused(client):
    emb = Embedding(N, D, optimizer=Optimizer("adagrad", lr=0.1))
    assert client.create_tables([emb.table_spec("spec/t")]) == {"spec/t": True}
    assert client.create_tables([emb.table_spec("spec/t")]) == {"spec/t": False}
    other = Embedding(N, D, optimizer=Optimizer("adagrad", lr=0.2))
    with pytest.raises(SpecConflictError, match="spec/t"):
        client.create_tables([other.table_spec("spec/t")])
    client.create_variables({"spec/w": torch.zeros(3)})
    with pytest.raises(SpecConflictError, match="share one namespace"):
        client.create_tables([emb.table_spec("spec/w")])
    with pytest.raises(SpecConflictError, match="share one namespace"):
        client.create_variables({"spec/t": torch.zeros(3)})


# -- bad input, straight through the generated stubs ------------------------------------------------


@pytest.fixture
def raw(client):
    """(client, a fixed table "bad/t" on both shards, a variable "bad/w" on shard 0 (this client's first name),
    a stub per shard)."""
    emb = Embedding(N, D, optimizer=Optimizer("sgd", lr=1.0))
    client.create_tables([emb.table_spec("bad/t")])
    client.create_variables({"bad/w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
    channels = [grpc.insecure_channel(address) for address in client.cluster.ps]
    yield client, [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
    for channel in channels:
        channel.close()


def _snapshot(client: PSClient) -> tuple:
    statuses = [client.status(s) for s in range(2)]
    return (_table(client, "bad/t", torch.arange(N)).tolist(), client.pull(["bad/w"])["bad/w"].tolist(),
            [s.step for s in statuses], [[(t.name, t.rows, t.optimizer_steps, t.rows_pushed) for t in s.tables]
                                          for s in statuses])


def _lookup(stub, name: str, ids: list[int]) -> grpc.RpcError:
    request = ps_pb2.LookupRowsRequest(tables=[ps_pb2.TableIds(name=name, ids=struct.pack(f"<{len(ids)}q", *ids))],
                                       admit=True)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.LookupRows(request, timeout=TIMEOUT))
    return caught.value


@pytest.mark.parametrize("name,ids,code,says", [
    ("bad/nope", [0], grpc.StatusCode.NOT_FOUND, "no embedding table 'bad/nope'"),
    ("bad/t", [0, N], grpc.StatusCode.INVALID_ARGUMENT, f"ids must be in [0, {N})"),
    ("bad/t", [0, 1], grpc.StatusCode.INVALID_ARGUMENT, "are not on shard 0"),
    ("bad/t", [2, 2], grpc.StatusCode.INVALID_ARGUMENT, "unique"),
])
def test_bad_lookups_are_refused_and_change_nothing(raw, name, ids, code, says):
    client, stubs = raw
    before = _snapshot(client)
    error = _lookup(stubs[0], name, ids)
    assert error.code() == code and says in error.details(), error.details()
    assert _snapshot(client) == before


def _push(stub, tensors: dict[str, tuple[ps_pb2.TensorMeta, bytes]]) -> grpc.RpcError:
    header = ps_pb2.PushHeader(worker="bad", step=0, step_increment=1, tensors=len(tensors))
    chunks = [ps_pb2.TensorChunk(name=name, meta=meta, offset=0, data=data) for name, (meta, data) in tensors.items()]
    with pytest.raises(grpc.RpcError) as caught:
        stub.Push(iter([ps_pb2.PushRequest(header=header, chunks=chunks)]), timeout=TIMEOUT)
    return caught.value


def _rows(ids: list[int], values: torch.Tensor) -> tuple[ps_pb2.TensorMeta, bytes]:
    encoded = rows.encode_rows(torch.tensor(ids), values)
    return encoded.meta, encoded.payload.numpy().tobytes()


GOOD_W = (ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[2]), struct.pack("<2f", 1.0, 1.0))


@pytest.mark.parametrize("tensors,code,says", [
    ({"bad/nope": _rows([0], torch.ones(1, D))}, grpc.StatusCode.NOT_FOUND, "no embedding table 'bad/nope'"),
    ({"bad/t": _rows([0, N], torch.ones(2, D))}, grpc.StatusCode.INVALID_ARGUMENT, f"ids must be in [0, {N})"),
    ({"bad/t": _rows([0, 1], torch.ones(2, D))}, grpc.StatusCode.INVALID_ARGUMENT, "are not on shard 0"),
    ({"bad/t": _rows([0], torch.ones(1, D + 1))}, grpc.StatusCode.INVALID_ARGUMENT, f"takes [rows, {D}]"),
    ({"bad/t": _rows([0], torch.ones(1, D, dtype=torch.float64))}, grpc.StatusCode.INVALID_ARGUMENT, "float32"),
    # With a good dense gradient in the same push: all or nothing.
    ({"bad/w": GOOD_W, "bad/t": _rows([0, 2], torch.tensor([[1.0] * D, [float("nan")] * D]))},
     grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
])
def test_bad_row_pushes_are_refused_and_change_nothing(raw, tensors, code, says):
    client, stubs = raw
    before = _snapshot(client)
    error = _push(stubs[0], tensors)
    assert error.code() == code and says in error.details(), error.details()
    assert _snapshot(client) == before


def test_the_client_refuses_nonfinite_row_gradients_before_sending(raw):
    client, _ = raw
    before = _snapshot(client)
    with pytest.raises(NonFiniteGradientError):
        client.push({"bad/w": torch.ones(2)}, rows={"bad/t": (torch.tensor([0, 1]), torch.full((2, D), float("inf")))})
    assert _snapshot(client) == before
