"""Delta pulls' core (ps_server/deltas.py, VariableStore.read_delta): what an update changed, bit for bit,
with threads (no sockets)."""

import threading

import pytest
import torch

from torchps import compression
from torchps.proto import ps_pb2
from torchps.ps_server.deltas import MAX_LOG_FRACTION, ChangeLog, changed_elements, delta_pays, keeps_zeros
from torchps.ps_server.store import NewVariable, VariableStore

N = 4000


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32) if tensor.dtype == torch.float32 else tensor.view(torch.int64)


def _sparse_grad(seed: int, count: int, n: int = N, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    grad = torch.zeros(n, dtype=dtype)
    grad[torch.randperm(n, generator=generator)[:count]] = torch.randn(count, generator=generator, dtype=dtype)
    return grad


class Copy:
    """A worker's copy of one variable, kept by delta reads as a client keeps it."""

    def __init__(self, store: VariableStore, name: str):
        self.store, self.name = store, name
        self.version, self.value = store.read(name, lambda value, version: (version, value.clone()))
        self.deltas = 0

    def pull(self) -> None:
        if self.store.read_delta(self.name, self.version) is None:  # whole (and the log starts at first)
            self.version, self.value = self.store.read(self.name, lambda value, version: (version, value.clone()))
            return
        self.version, index, values = self.store.read_delta(self.name, self.version)
        self.value.view(-1)[index.long()] = values
        self.deltas += 1


@pytest.mark.parametrize("optimizer, hyper", [("sgd", {"lr": 0.5}), ("adagrad", {"lr": 0.1})])
def test_a_copy_kept_by_deltas_equals_the_variable_bit_for_bit(optimizer, hyper):
    """Sparse updates (dense gradients with zeros, and SPARSE-decoded ones) arrive as deltas; zeros of both
    signs in the value and -0.0 in gradients included."""
    store = VariableStore()
    start = torch.randn(N)
    start[:50], start[50:100] = 0.0, -0.0
    store.create([NewVariable("w", start, optimizer, hyper)])
    copy = Copy(store, "w")
    copy.pull()  # starts the log: whole
    for step in range(12):
        if step % 2:
            grad = _sparse_grad(step, 300)
            grad[:100:3] = -0.0  # flips the sign of a -0.0 value: must travel
        else:
            index = torch.randperm(N, generator=torch.Generator().manual_seed(step))[:200].sort().values
            meta = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[N], encoding=ps_pb2.SPARSE, nnz=200)
            raw = torch.cat([index.int().view(torch.uint8), torch.randn(200).view(torch.uint8)]).numpy()
            grad = compression.decode("w", meta, raw, meta)
        store.apply({"w": grad})
        copy.pull()
        held = store.read("w", lambda value, version: value.clone())
        assert torch.equal(_bits(copy.value), _bits(held)), f"step {step}"
    assert copy.deltas == 11  # all but the first: version 0 (as created) is "no base" on the wire


@pytest.mark.parametrize("hyper", [{"momentum": 0.9}, {"weight_decay": 0.01}, {"maximize": 1}])
def test_updates_that_touch_every_element_are_pulled_whole(hyper):
    store = VariableStore()
    store.create([NewVariable("w", torch.randn(N), "sgd", {"lr": 0.5, **hyper})])
    copy = Copy(store, "w")
    copy.pull()
    for step in range(3):
        store.apply({"w": _sparse_grad(step, 10)})
        copy.pull()
        assert torch.equal(copy.value, store.read("w", lambda value, version: value.clone()))
    assert copy.deltas == 0


def test_a_hyperparameter_change_to_weight_decay_stops_deltas_from_then_on():
    """Weight decay moves every element, whatever its gradient (momentum would too, but turning it on after
    the first step is refused: UpdateOptimizer's structural changes)."""
    store = VariableStore()
    store.create([NewVariable("w", torch.randn(N), "sgd", {"lr": 0.5})])
    store.apply({"w": _sparse_grad(99, 10)})  # version 1: version 0 is "no base"
    copy = Copy(store, "w")
    copy.pull()
    store.apply({"w": _sparse_grad(1, 10)})
    copy.pull()
    assert copy.deltas == 1
    store.set_hyperparams(["w"], {"weight_decay": 0.01})
    store.apply({"w": _sparse_grad(2, 10)})
    assert store.read_delta("w", copy.version) is None
    copy.pull()
    assert torch.equal(copy.value, store.read("w", lambda value, version: value.clone()))


def test_a_base_too_old_for_the_log_or_unknown_is_answered_whole():
    """The log keeps at most numel / MAX_LOG_FRACTION indices: older versions are dropped."""
    store = VariableStore()
    store.create([NewVariable("w", torch.randn(N), "sgd", {"lr": 0.5})])
    assert store.read_delta("w", 0) is None  # starts the log at version 0
    per_update = N // MAX_LOG_FRACTION // 3 + 1  # three updates overflow it
    for step in range(4):
        store.apply({"w": _sparse_grad(step, per_update)})
    version = store.read("w", lambda value, version: version)
    assert store.read_delta("w", 1) is None, "dropped from the log"
    assert store.read_delta("w", version + 1) is None, "a version the variable never had"
    latest, index, values = store.read_delta("w", version - 1)
    assert latest == version and len(index) == per_update
    unchanged = store.read_delta("w", version)
    assert unchanged[0] == version and len(unchanged[1]) == len(unchanged[2]) == 0


def test_a_cast_delta_carries_the_values_cast():
    store = VariableStore()
    store.create([NewVariable("w", torch.randn(N), "sgd", {"lr": 0.5})])
    store.apply({"w": _sparse_grad(99, 10)})  # version 1: version 0 is "no base"
    store.read_delta("w", 1)
    store.apply({"w": _sparse_grad(0, 20)})
    version, index, values = store.read_delta("w", 1, torch.bfloat16)
    held = store.read("w", lambda value, version: value.clone())
    assert version == 2 and values.dtype == torch.bfloat16 and len(index) == 20
    assert torch.equal(values, held.view(-1)[index.long()].to(torch.bfloat16))


def test_the_changed_elements_of_a_gradient():
    grad = torch.zeros(10)
    grad[[2, 7]] = 1.0
    grad[4] = -0.0
    assert changed_elements(grad, 10).tolist() == [2, 4, 7]
    assert changed_elements(grad, 2) is None
    decoded = compression.decode("w", ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[10], encoding=ps_pb2.SPARSE,
                                                        nnz=1),
                                 torch.cat([torch.tensor([3], dtype=torch.int32).view(torch.uint8),
                                            torch.tensor([0.0]).view(torch.uint8)]).numpy(),
                                 ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[10]))
    assert changed_elements(decoded, 10).tolist() == [3], "a SPARSE push's indices, a zero value included"


def test_which_optimizers_keep_zero_gradient_elements():
    assert keeps_zeros("sgd", {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, "maximize": 0.0})
    assert not keeps_zeros("sgd", {"lr": 0.1, "momentum": 0.9})
    assert keeps_zeros("adagrad", {"lr": 0.1, "eps": 1e-10, "weight_decay": 0.0})
    assert not keeps_zeros("adagrad", {"lr": 0.1, "eps": 0.0}), "0/0 makes NaN where nothing was pushed"
    assert not keeps_zeros("adam", {"lr": 0.1})
    assert not keeps_zeros("none", {})


def test_the_log_unions_its_versions_and_forgets_before_an_every_element_update():
    log = ChangeLog(version=5, numel=800)
    log.record(6, torch.tensor([3, 9]))
    log.record(7, torch.tensor([1, 9]))
    assert log.since(5, 7).tolist() == [1, 3, 9]
    assert log.since(6, 7).tolist() == [1, 9]
    assert log.since(7, 7).tolist() == []
    assert log.since(4, 7) is None
    log.record(8, None)
    assert log.since(7, 8) is None and log.since(8, 8).tolist() == []
    assert log.nbytes == 0
    assert delta_pays(99, 800, 4) and not delta_pays(400, 800, 4)


def test_delta_reads_racing_updates_each_match_the_version_they_name():
    """A reader keeping its copy by deltas while a writer updates: every delta lands on exactly the version
    it names (the writer keeps a copy of each version)."""
    store = VariableStore()
    store.create([NewVariable("w", torch.randn(N), "sgd", {"lr": 0.5})])
    copy = Copy(store, "w")
    copy.pull()
    snapshots = {copy.version: copy.value.clone()}
    written = threading.Condition()
    updates = 200
    errors = []

    def write():
        for step in range(updates):
            store.apply({"w": _sparse_grad(step, 5)})
            version, value = store.read("w", lambda value, version: (version, value.clone()))
            with written:
                snapshots[version] = value
                written.notify_all()

    def read():
        try:
            while copy.version < updates:
                copy.pull()
                with written:  # the writer copies each version right after its update
                    assert written.wait_for(lambda: copy.version in snapshots, timeout=60), "no snapshot"
                assert torch.equal(copy.value, snapshots[copy.version]), f"version {copy.version}"
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[0]
    assert copy.version == updates and copy.deltas > 0
