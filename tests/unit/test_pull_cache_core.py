"""ps_server/pull_cache.py with threads (no sockets): one copy per version and cast, never a stale one, the quota."""

import threading

import numpy as np
import pytest
import torch

from torchps.ps_server.pull_cache import PullCache
from torchps.ps_server.quotas import Quotas
from torchps.ps_server.store import NewVariable, VariableStore

N = 1 << 19  # float32 elements: 2 MiB (1 MiB cast to 16 bits)
MIB = 1 << 20


def make(value: torch.Tensor | None = None, *, eager: bool = True, max_memory: int = 0, min_bytes: int = MIB):
    store = VariableStore()
    store.create([NewVariable("v", torch.zeros(N) if value is None else value, "sgd", {"lr": 1.0})])
    quotas = Quotas(max_memory=max_memory)
    return store, quotas, PullCache(quotas, lambda: store.get("v").nbytes, eager=lambda: eager, min_bytes=min_bytes)


def pulled(cache: PullCache, store: VariableStore, cast=None) -> tuple[int, bytes, int] | None:
    """(version, bytes, address) one pull would send from the cache, or None where it reads the variable."""
    with cache.lookup(store.get("v"), cast) as cached:
        return None if cached is None else (cached.version, bytes(cached.data), cached.data.ctypes.data)


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes() if tensor.dtype != torch.bfloat16 else tensor.view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("cast", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_second_pull_of_a_version_gets_the_first_one_s_bytes_equal_to_the_variable(cast):
    value = torch.randn(N, generator=torch.Generator().manual_seed(0))
    store, quotas, cache = make(value.clone())
    first = pulled(cache, store, cast)
    assert first[1] == as_bytes(value if cast is None else value.to(cast))  # Tensor.to's bytes, bit for bit
    assert (cache.fills, cache.hits) == (1, 0)
    assert pulled(cache, store, cast) == first and cache.hits == 1
    assert cache.nbytes == len(first[1]) == quotas._kept


def test_an_update_makes_the_entry_stale_and_the_next_pull_fills_in_its_memory():
    store, quotas, cache = make()
    before = pulled(cache, store)
    store.apply({"v": torch.ones(N)})
    after = pulled(cache, store)
    assert after[0] == before[0] + 1 and after[1] == as_bytes(torch.full((N,), -1.0))
    assert after[2] == before[2]  # the stale entry's memory, which no pull held any more
    assert cache.fills == 2 and cache.hits == 0 and cache.nbytes == 4 * N == quotas._kept


def test_a_stale_entry_a_pull_still_sends_from_keeps_its_bytes_and_its_count_until_it_ends():
    store, quotas, cache = make()
    with cache.lookup(store.get("v")) as old:
        kept = bytes(old.data)
        store.apply({"v": torch.ones(N)})
        new = pulled(cache, store)
        assert new[0] == old.version + 1 and new[2] != old.data.ctypes.data
        assert bytes(old.data) == kept and cache.nbytes == 2 * 4 * N == quotas._kept
        with pytest.raises(ValueError):
            old.data[0] = 1  # immutable
    assert cache.nbytes == 4 * N == quotas._kept


def test_outside_sync_mode_a_version_is_cached_by_its_third_pull_or_its_second_cast_one():
    store, _, cache = make(eager=False)
    assert pulled(cache, store) is None and pulled(cache, store) is None and cache.fills == 0
    assert pulled(cache, store) is not None and (cache.fills, cache.hits) == (1, 0)
    assert pulled(cache, store) is not None and cache.hits == 1
    assert pulled(cache, store, torch.bfloat16) is None  # counted per cast
    assert pulled(cache, store, torch.bfloat16) is not None and cache.fills == 2
    store.apply({"v": torch.ones(N)})
    assert pulled(cache, store) is None and pulled(cache, store) is None  # a new version: counted again
    assert pulled(cache, store)[1] == as_bytes(torch.full((N,), -1.0))


def test_small_variables_and_a_cache_turned_off_cache_nothing():
    store, _, cache = make(min_bytes=4 * N + 1)
    assert pulled(cache, store) is None and pulled(cache, store, torch.bfloat16) is None
    store, _, cache = make()
    cache.enabled = False
    assert pulled(cache, store) is None and cache.nbytes == 0


def test_no_room_under_max_memory_caches_nothing_and_drop_gives_the_room_back():
    store, quotas, cache = make(max_memory=4 * N + 4 * N // 2)  # the variable and half a copy
    assert pulled(cache, store) is None and cache.nbytes == 0 == quotas._kept
    store, quotas, cache = make(max_memory=2 * 4 * N)
    assert pulled(cache, store) is not None and quotas._kept == 4 * N
    with cache.lookup(store.get("v")) as held:
        assert cache.drop() == 0  # in use: counted until its pull ends
        assert held is not None and quotas._kept == 4 * N
    assert quotas._kept == 0 == cache.nbytes
    assert pulled(cache, store) is not None
    assert cache.drop() == 4 * N and quotas._kept == 0


def test_pulls_at_once_make_one_copy_and_every_pull_gets_one_version_while_updates_race():
    """Eight threads pull at once: one fills, the others wait for it and send its bytes. Then pulls race
    updates: each pull's bytes are exactly the version it names (SGD lr 1 on zeros, a gradient of ones: -version
    everywhere), and a pull never gets a version older than the one the variable had when it began."""
    store, _, cache = make()
    start, results = threading.Barrier(8), []

    def pull():
        start.wait(timeout=30)
        results.append(pulled(cache, store))

    threads = [threading.Thread(target=pull) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len({r[1] for r in results}) == 1 and (cache.fills, cache.hits) == (1, 7)

    errors, done = [], threading.Event()

    def update():
        for _ in range(30):
            store.apply({"v": torch.ones(N)})
        done.set()

    def check():
        while not done.is_set():
            begun = store.get("v").version
            with cache.lookup(store.get("v")) as cached:
                if cached is None:
                    continue
                values = np.frombuffer(cached.data, dtype=np.float32)
                if cached.version < begun or not (values == -float(cached.version)).all():
                    errors.append((begun, cached.version, np.unique(values)[:4]))

    threads = [threading.Thread(target=update)] + [threading.Thread(target=check) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and cache.fills > 1
    assert cache.nbytes == 4 * N  # one version kept
