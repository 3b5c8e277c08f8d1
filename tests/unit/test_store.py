"""VariableStore: idempotent creation, all-or-nothing pushes, atomic reads, with threads (no sockets)."""

import threading

import pytest
import torch

from torchps.errors import (NonFiniteGradientError, OptimizerSpecError, SpecConflictError,
                                      TensorMismatchError, UnknownVariableError, WaitTimeoutError)
from torchps.ps_server.store import NewVariable, VariableStore


def _sgd(name, value, lr=1.0, **hyper):
    return NewVariable(name, value, "sgd", {"lr": lr, **hyper})


def _value(store, name):
    return store.read(name, lambda value, version: value.clone())


def _version(store, name):
    return store.read(name, lambda value, version: version)


def _run_threads(targets):
    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


# -- creation ------------------------------------------------------------------------------------

def test_create_is_idempotent_and_keeps_the_value():
    """Same spec again: False, and the first value stays (also when defaults are spelled out)."""
    store = VariableStore()
    assert store.create([_sgd("w", torch.ones(3)), NewVariable("b", torch.zeros(2))]) == [True, True]
    assert store.create([_sgd("w", torch.full((3,), 7.0), momentum=0.0, nesterov=False)]) == [False]
    store.apply({"w": torch.ones(3)})
    assert store.create([NewVariable("b", torch.ones(2)), _sgd("w", torch.ones(3))]) == [False, False]
    assert torch.equal(_value(store, "w"), torch.zeros(3))
    assert torch.equal(_value(store, "b"), torch.zeros(2))
    assert _version(store, "w") == 1
    assert store.names() == ["w", "b"]


def test_create_repeated_name_in_one_call():
    store = VariableStore()
    assert store.create([_sgd("w", torch.ones(2)), _sgd("w", torch.zeros(2))]) == [True, False]
    assert torch.equal(_value(store, "w"), torch.ones(2))


@pytest.mark.parametrize("second, shown", [
    (_sgd("w", torch.ones(4)), "float32[4]"),
    (_sgd("w", torch.ones(3, dtype=torch.float64)), "float64[3]"),
    (_sgd("w", torch.ones(3), lr=0.5), "lr=0.5"),
    (NewVariable("w", torch.ones(3), "adam"), "optimizer=adam"),
])
def test_create_with_another_spec_conflicts(second, shown):
    """A different spec raises SpecConflictError showing both specs; the variable is untouched."""
    store = VariableStore()
    store.create([_sgd("w", torch.ones(3))])
    with pytest.raises(SpecConflictError) as info:
        store.create([second])
    message = str(info.value)
    assert "'w'" in message
    assert "float32[3] optimizer=sgd(" in message and "lr=1" in message  # the existing spec
    assert shown in message  # the requested spec
    assert torch.equal(_value(store, "w"), torch.ones(3))


def test_create_is_all_or_nothing():
    """One conflicting variable: none of the call's new variables is stored."""
    store = VariableStore()
    store.create([_sgd("w", torch.ones(3))])
    with pytest.raises(SpecConflictError):
        store.create([_sgd("new1", torch.ones(1)), _sgd("w", torch.ones(5)), _sgd("new2", torch.ones(1))])
    with pytest.raises(SpecConflictError):
        store.create([_sgd("new3", torch.ones(1)), _sgd("new3", torch.ones(2))])
    with pytest.raises(OptimizerSpecError):
        store.create([_sgd("new4", torch.ones(1)), NewVariable("new5", torch.ones(1), "rmsprop")])
    with pytest.raises(OptimizerSpecError, match="floating-point"):
        store.create([_sgd("new6", torch.ones(1)), _sgd("ints", torch.ones(2, dtype=torch.int64))])
    assert store.names() == ["w"]


def test_spec_is_normalized():
    store = VariableStore()
    store.create([NewVariable("w", torch.ones(2), "ADAM", {"lr": 0.1})])
    spec = store.get("w").spec
    assert spec.optimizer.name == "adam"
    assert dict(spec.optimizer.hyperparams) == pytest.approx(
        {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "amsgrad": 0.0, "maximize": 0.0})


# -- apply ---------------------------------------------------------------------------------------

def _two_sgd():
    store = VariableStore()
    store.create([_sgd("a", torch.zeros(4)), _sgd("b", torch.zeros(2, 2)), NewVariable("frozen", torch.zeros(3))])
    return store


@pytest.mark.parametrize("bad, error", [
    ({"nope": torch.ones(3)}, UnknownVariableError),
    ({"b": torch.ones(4)}, TensorMismatchError),
    ({"b": torch.ones(2, 2, dtype=torch.float64)}, TensorMismatchError),
    ({"b": torch.tensor([[1.0, float("nan")], [1.0, 1.0]])}, NonFiniteGradientError),
    ({"b": torch.tensor([[1.0, float("-inf")], [1.0, 1.0]])}, NonFiniteGradientError),
    ({"frozen": torch.ones(3)}, TensorMismatchError),  # optimizer 'none' takes no gradients
])
def test_apply_validates_everything_first(bad, error):
    """One bad gradient (even the last one): nothing is applied to any variable, versions and step unchanged."""
    store = _two_sgd()
    with pytest.raises(error):
        store.apply({"a": torch.ones(4), **bad}, step_increment=1)
    assert torch.equal(_value(store, "a"), torch.zeros(4))
    assert torch.equal(_value(store, "b"), torch.zeros(2, 2))
    assert [_version(store, n) for n in ("a", "b", "frozen")] == [0, 0, 0]
    assert store.step == 0


def test_allow_nonfinite_accepts_nan():
    store = VariableStore(allow_nonfinite=True)
    store.create([_sgd("a", torch.zeros(2))])
    store.apply({"a": torch.tensor([float("nan"), 1.0])})
    value = _value(store, "a")
    assert torch.isnan(value[0]) and value[1] == -1


def test_versions_and_step():
    """Each apply bumps the versions of its variables by one and the step by step_increment."""
    store = _two_sgd()
    assert store.apply({"a": torch.ones(4)}, step_increment=1) == (1, {"a": 1})
    assert store.apply({"a": torch.ones(4), "b": torch.ones(2, 2)}, step_increment=1) == (2, {"a": 2, "b": 1})
    assert store.apply({"b": torch.ones(2, 2)}) == (2, {"b": 2})
    assert store.apply({}, step_increment=3) == (5, {})
    assert store.step == 5
    assert torch.equal(_value(store, "a"), torch.full((4,), -2.0))
    assert _version(store, "frozen") == 0


def test_unknown_variable_lookups():
    store = VariableStore()
    with pytest.raises(UnknownVariableError, match="'x'"):
        store.get("x")
    with pytest.raises(UnknownVariableError):
        store.read("x", lambda value, version: value)


# -- waiting -------------------------------------------------------------------------------------

def test_wait_for_wakes_when_another_thread_creates():
    store = VariableStore()
    waiting = threading.Event()
    woke = []

    def waiter():
        waiting.set()
        store.wait_for(["x", "y"], timeout=60)
        woke.append(store.names())

    def creator():
        waiting.wait()
        store.create([NewVariable("x", torch.ones(1))])
        store.create([NewVariable("y", torch.ones(1))])

    _run_threads([waiter, creator])
    assert woke == [["x", "y"]]


def test_wait_for_returns_at_once_when_present():
    store = VariableStore()
    store.create([NewVariable("x", torch.ones(1))])
    store.wait_for(["x"], timeout=0)


def test_wait_for_times_out_naming_the_missing():
    store = VariableStore()
    store.create([NewVariable("present", torch.ones(1))])
    with pytest.raises(WaitTimeoutError) as info:
        store.wait_for(["present", "missing_one"], timeout=0.05)
    assert "'missing_one'" in str(info.value)
    assert "'present'" not in str(info.value)


# -- concurrency ---------------------------------------------------------------------------------

def test_concurrent_applies_lose_nothing():
    """8 threads x 200 pushes of ones with SGD lr=1: exactly -1600 everywhere."""
    store = VariableStore()
    store.create([_sgd("a", torch.zeros(1000)), _sgd("b", torch.zeros(7, 3))])
    threads, pushes = 8, 200
    start = threading.Barrier(threads)

    def pusher():
        start.wait()
        for _ in range(pushes):
            store.apply({"a": torch.ones(1000), "b": torch.ones(7, 3)}, step_increment=1)

    _run_threads([pusher] * threads)
    assert torch.equal(_value(store, "a"), torch.full((1000,), -1600.0))
    assert torch.equal(_value(store, "b"), torch.full((7, 3), -1600.0))
    assert (_version(store, "a"), _version(store, "b"), store.step) == (1600, 1600, 1600)


def test_reads_are_atomic_during_applies():
    """A reader never sees a tensor with elements from two different versions."""
    store = VariableStore()
    n = 1 << 20
    store.create([_sgd("w", torch.zeros(n))])
    done = threading.Event()
    seen = []

    def pusher():
        try:
            for _ in range(60):
                store.apply({"w": torch.ones(n)})
        finally:
            done.set()

    def reader():
        while not done.is_set() or len(seen) < 5:
            value, version = store.read("w", lambda value, version: (value.clone(), version))
            lo, hi = value.min().item(), value.max().item()
            seen.append((lo, hi, version))

    _run_threads([pusher, pusher, reader])
    torn = [(lo, hi, v) for lo, hi, v in seen if lo != hi or lo != -v]
    assert not torn, f"{len(torn)} of {len(seen)} reads saw a torn or mislabeled tensor: {torn[:3]}"
    assert _version(store, "w") == 120


# -- hyperparameters -----------------------------------------------------------------------------

def test_set_hyperparams_changes_lr_for_the_next_step():
    store = VariableStore()
    store.create([_sgd("a", torch.zeros(2)), _sgd("b", torch.zeros(2)), NewVariable("frozen", torch.zeros(1))])
    store.apply({"a": torch.ones(2), "b": torch.ones(2)})
    assert store.set_hyperparams(["a"], {"lr": 0.5}) == 1
    store.apply({"a": torch.ones(2), "b": torch.ones(2)})
    assert torch.equal(_value(store, "a"), torch.full((2,), -1.5))
    assert torch.equal(_value(store, "b"), torch.full((2,), -2.0))
    assert store.set_hyperparams([], {"lr": 0.25}) == 2  # every trainable variable
    store.apply({"a": torch.ones(2), "b": torch.ones(2)})
    assert torch.equal(_value(store, "a"), torch.full((2,), -1.75))
    assert torch.equal(_value(store, "b"), torch.full((2,), -2.25))
    assert store.get("a").optimizer.current()["lr"] == 0.25


def test_set_hyperparams_keeps_the_created_spec():
    """Idempotent create compares with the spec as created, not the current lr."""
    store = VariableStore()
    store.create([_sgd("a", torch.zeros(2), lr=1.0)])
    store.set_hyperparams(["a"], {"lr": 0.1})
    assert store.create([_sgd("a", torch.zeros(2), lr=1.0)]) == [False]
    assert store.get("a").spec.optimizer.hyperparams["lr"] == 1.0


@pytest.mark.parametrize("names, updates, match", [
    (["a", "m"], {"lr": 0.5, "bogus": 1.0}, "bogus"),
    (["a", "m"], {"momentum": 0.9}, "momentum"),   # valid for SGD 'a', unknown to Adam 'm'
    ([], {"momentum": 0.9}, "momentum"),
    (["a", "frozen"], {"lr": 0.5}, "no optimizer"),
])
def test_bad_set_hyperparams_changes_nothing(names, updates, match):
    store = VariableStore()
    store.create([_sgd("a", torch.zeros(2)), NewVariable("m", torch.zeros(2), "adam"),
                  NewVariable("frozen", torch.zeros(1))])
    before = {n: store.get(n).optimizer.current() for n in ("a", "m")}
    with pytest.raises(OptimizerSpecError, match=match):
        store.set_hyperparams(names, updates)
    assert {n: store.get(n).optimizer.current() for n in ("a", "m")} == before
    store.apply({"a": torch.ones(2)})
    assert torch.equal(_value(store, "a"), torch.full((2,), -1.0))


def test_set_hyperparams_unknown_variable():
    store = VariableStore()
    store.create([_sgd("a", torch.zeros(2))])
    with pytest.raises(UnknownVariableError):
        store.set_hyperparams(["a", "zzz"], {"lr": 0.5})
    assert store.get("a").optimizer.current()["lr"] == 1.0


# -- versioned reads: a big variable read a chunk at a time, as one version ---------------------

def _read_all(read, chunk):
    parts = []
    while read.offset < read.nbytes:
        parts.append(read.take(chunk, lambda view, offset: bytes(view)))
    return b"".join(parts)


def test_a_versioned_read_keeps_its_version_when_an_update_lands_mid_read():
    store = VariableStore()
    store.create([_sgd("w", torch.arange(1024, dtype=torch.float32))])
    before = _value(store, "w")
    with store.versioned_read("w") as read:
        first = read.take(1000, lambda view, offset: bytes(view))
        store.apply({"w": torch.ones(1024)})  # lr 1: every element drops by one
        rest = _read_all(read, 1000)
        assert read.version == 0
    got = torch.frombuffer(bytearray(first + rest), dtype=torch.float32)
    assert torch.equal(got, before)
    assert torch.equal(_value(store, "w"), before - 1)
    assert store.get("w").readers == []


def test_a_versioned_read_copies_nothing_when_no_update_races_it():
    store = VariableStore()
    store.create([_sgd("w", torch.arange(1024, dtype=torch.float32))])
    with store.versioned_read("w") as read:
        read.take(1000, lambda view, offset: None)
        assert read._frozen is None
        store.apply({"w": torch.ones(1024)})
        assert read._frozen is not None and read._frozen.nbytes == 4096 - 1000  # only the unread bytes
    store.apply({"w": torch.ones(1024)})  # the read is closed: nothing is preserved for it any more
    assert store.get("w").readers == [] and read._frozen is None


def test_reads_and_updates_in_threads_never_see_a_torn_version():
    """Every element of a version equals the same number: a read mixing two versions would show two."""
    store = VariableStore()
    store.create([_sgd("w", torch.zeros(1 << 16))])
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            with store.versioned_read("w") as read:
                values = torch.frombuffer(bytearray(_read_all(read, 4096 * 3)), dtype=torch.float32)
            seen.append(values.unique().numel())

    def updater():
        for _ in range(300):
            store.apply({"w": torch.ones(1 << 16)})
        stop.set()

    _run_threads([reader, reader, updater])
    assert seen and set(seen) == {1}
