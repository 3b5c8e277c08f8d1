"""A pulled variable's bytes made once per version and shared by every pull of that version. No gRPC.

A sync job's workers all pull the version each release made, so a shard used
to copy (or cast to bf16/fp16) each variable once per worker and step. A
PullCache keeps, per (variable, cast), one immutable copy of the bytes a pull
sends, made from one version (reads.VersionedRead: a chunk at a time under
the variable's lock) and valid for that version only: a pull that finds the
variable's version there sends from it (a lane straight from its memory, an
inline reply encoding from it); once an update made it stale it is never
served again, and the next fill of its (variable, cast) replaces it, in its
memory once no pull sends from it.

When an entry is made: in sync mode (`eager()`) by the first pull of a
version; otherwise, where each push makes a new version, by a later pull of
one version (LAZY_FILL_PULLS). Only variables of `min_bytes` or more (as
sent) are cached. A pull that wants an entry another pull is filling waits
for the fill (a copy in memory, never the network), then sends from it.

Memory: an entry's bytes count against --max-memory as kept bytes
(Quotas.keep) from its fill until it has left the cache and no pull sends
from it. A fill that does not fit is not made (the pull reads the variable as
before), and drop() lets every entry go (a push that needs the room).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Iterator

import numpy as np
import torch

from .quotas import Quotas
from .reads import VersionedRead

__all__ = ["MIN_CACHED_BYTES", "Cached", "PullCache"]

MIN_CACHED_BYTES = 1 << 20  # the client's lane threshold and default chunk: a smaller pull's copy costs little
FILL_STEP_BYTES = 4 << 20  # bytes as stored copied per hold of the variable's lock while an entry fills
MAX_FILL_WAIT_SECONDS = 60.0  # a fill is one copy in memory; a pull waiting longer reads the variable itself
# Outside sync mode, the pull of one version that makes its entry, as stored and cast. Making an entry costs a
# copy of the variable, about what a pull as stored saves by sending from it: such an entry pays from a version's
# third pull. A cast costs more than a copy (and takes fresh memory each time): a cast entry pays from the second.
LAZY_FILL_PULLS = {False: 3, True: 2}


class Cached:
    """One variable's bytes at one version, as a pull sends them: `data`, a read-only uint8 array, once `ready`
    is set; `version`, the variable's version they are."""

    __slots__ = ("owner", "version", "data", "ready", "failed", "users", "counted", "cached")

    def __init__(self, owner: weakref.ref, version: int):
        self.owner, self.version = owner, version
        self.data: np.ndarray | None = None
        self.ready = threading.Event()
        self.failed = False
        self.users = 1      # pulls holding it, the one filling it first (under the cache's lock)
        self.counted = 0    # its bytes counted against the quota
        self.cached = True  # in the cache's table; else only its users hold it

    def serves(self, variable, version: int) -> bool:
        """Whether it holds `variable` at `version` or later (a pull that read `version` may send it)."""
        return not self.failed and self.owner() is variable and self.version >= version


class PullCache:
    """Per (variable name, cast dtype or None), the bytes of the newest version pulled. Thread-safe; its lock
    guards its table only and is never held while copying, waiting or calling the quota."""

    def __init__(self, quotas: Quotas, held: Callable[[], int], *, enabled: bool = True,
                 eager: Callable[[], bool] = lambda: False, min_bytes: int = MIN_CACHED_BYTES):
        self._quotas, self._held, self._eager = quotas, held, eager
        self.enabled, self.min_bytes = enabled, min_bytes
        self._lock = threading.Lock()
        self._entries: dict[tuple, Cached] = {}
        self._seen: dict[tuple, tuple[weakref.ref, int, int]] = {}  # (variable, version, pulls) read uncached
        self._counted = 0
        self.hits = 0   # pulls served from an entry another pull made (tests and GetStatus read it)
        self.fills = 0  # entries made

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold, those only pulls in progress still send from included."""
        with self._lock:
            return self._counted

    @contextlib.contextmanager
    def lookup(self, variable, cast: torch.dtype | None = None) -> Iterator[Cached | None]:
        """Yields the Cached bytes of `variable` (a store.Variable), cast to `cast`, at the version it had when
        called or a later one; or None, where the pull reads the variable itself: caching off, a variable under
        min_bytes, a version not pulled before (outside sync mode), no room under --max-memory, a fill that
        failed. Blocks while the entry fills (by this call or another one), never on the network. Its bytes
        must not be used once the block has ended."""
        entry = self._acquire(variable, cast) if self.enabled else None
        try:
            yield entry
        finally:
            if entry is not None:
                self._let_go(entry)

    def drop(self) -> int:
        """Lets every entry go; their bytes stop counting once no pull sends from them. The bytes freed now."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
            self._seen.clear()
            for entry in entries:
                entry.cached = False
            freed = self._free([entry for entry in entries if not entry.users])
        if freed:
            self._quotas.release_kept(freed)
        return freed

    # -- inside ---------------------------------------------------------------------------------------------

    def _acquire(self, variable, cast: torch.dtype | None) -> Cached | None:
        size = variable.nbytes if cast is None else variable.value.numel() * cast.itemsize
        if size < self.min_bytes:
            return None
        key, version = (variable.spec.name, cast), variable.version  # read without its lock: updates are whole
        enough = 1 if self._eager() else LAZY_FILL_PULLS[cast is not None]
        with self._lock:
            entry = self._use(key, variable, version)
            if entry is None and not self._pulled_enough(key, variable, version, enough):
                return None
        if entry is None:
            entry, filling = self._begin(key, variable, version, size, cast)
            if filling:
                return entry
        if not entry.ready.wait(MAX_FILL_WAIT_SECONDS) or entry.failed:
            self._let_go(entry)
            return None
        with self._lock:
            self.hits += 1
        return entry

    def _use(self, key: tuple, variable, version: int) -> Cached | None:
        """The entry of `key` that serves `variable` at `version`, now held; None if none does. Under the lock."""
        entry = self._entries.get(key)
        if entry is None or not entry.serves(variable, version):
            return None
        entry.users += 1
        return entry

    def _pulled_enough(self, key: tuple, variable, version: int, enough: int) -> bool:
        """Whether this pull of `variable` at `version` is its `enough`th or later; else it is counted. Under
        the lock."""
        seen = self._seen.get(key)
        pulls = seen[2] + 1 if seen is not None and seen[0]() is variable and seen[1] == version else 1
        if pulls >= enough:
            return True
        self._seen[key] = (weakref.ref(variable), version, pulls)
        return False

    def _begin(self, key: tuple, variable, version: int, size: int, cast) -> tuple[Cached | None, bool]:
        """(entry, True) filled by this call, ready, or (None, True) where it could not be; (entry, False) if
        another pull began one meanwhile (held, maybe still filling)."""
        read = VersionedRead(variable).open()  # the version it fills, known before anyone waits on it
        try:
            with self._lock:
                entry = self._use(key, variable, version)
                if entry is not None:
                    return entry, False
                entry = Cached(weakref.ref(variable), read.version)
                old = self._entries.get(key)
                self._entries[key] = entry
                self._seen.pop(key, None)
                gone = [k for k, e in self._entries.items() if e.owner() is None]  # variables that left the shard
                stale = [self._entries.pop(k) for k in gone] + ([old] if old is not None else [])
                for item in stale:
                    item.cached = False
                if old is not None and not old.users and old.data is not None and old.data.nbytes == size:
                    entry.data, entry.counted, old.data, old.counted = old.data, old.counted, None, 0
                freed = self._free([item for item in stale if not item.users])
            if freed:
                self._quotas.release_kept(freed)
            return (entry if self._fill(key, entry, read, size, cast) else None), True
        finally:
            read.close()

    def _fill(self, key: tuple, entry: Cached, read: VersionedRead, size: int, cast) -> bool:
        """Copies `read` into `entry` (in memory counted first) and sets it ready; False, the entry failed and
        let go, where the quota or the allocator has no room. Raises (the entry failed) on anything else."""
        try:
            if entry.data is None:
                if not self._quotas.keep(self._held, size):
                    self._fail(key, entry)
                    return False
                with self._lock:
                    entry.counted = size
                    self._counted += size
                entry.data = np.empty(size, dtype=np.uint8)
            entry.data.flags.writeable = True
            _copy(read, entry.data, cast)
            entry.data.flags.writeable = False
        except MemoryError:
            self._fail(key, entry)
            return False
        except BaseException:
            self._fail(key, entry)
            raise
        with self._lock:
            self.fills += 1
        entry.ready.set()
        return True

    def _fail(self, key: tuple, entry: Cached) -> None:
        """Takes `entry` out of the table and lets the filling pull's hold go; the pulls waiting on it read the
        variable themselves."""
        with self._lock:
            entry.failed = True
            if self._entries.get(key) is entry:
                del self._entries[key]
            entry.cached = False
        entry.ready.set()
        self._let_go(entry)

    def _let_go(self, entry: Cached) -> None:
        with self._lock:
            entry.users -= 1
            freed = self._free([entry]) if not entry.users and not entry.cached else 0
        if freed:
            self._quotas.release_kept(freed)

    def _free(self, entries: list[Cached]) -> int:
        """Lets the memory of `entries` (out of the table, unused) go; the bytes they counted. Under the lock."""
        freed = 0
        for entry in entries:
            freed += entry.counted
            entry.counted, entry.data = 0, None
        self._counted -= freed
        return freed


def _copy(read: VersionedRead, out: np.ndarray, cast: torch.dtype | None) -> None:
    """The whole of `read` into `out`, as stored or converted to `cast` (as Tensor.to converts), a step at a time."""
    stored = read.variable.value.dtype
    width = read.variable.value.element_size()

    def take(view: memoryview, offset: int) -> None:
        if cast is None:
            out[offset:offset + len(view)] = np.frombuffer(view, dtype=np.uint8)
        else:
            start, nbytes = offset // width * cast.itemsize, len(view) // width * cast.itemsize
            torch.from_numpy(out[start:start + nbytes]).view(cast).copy_(torch.frombuffer(view, dtype=stored))

    while read.offset < read.nbytes:
        read.take(FILL_STEP_BYTES // width * width, take)
