"""The soak's resizes that fail (bench/soak.py): a fault during a live shard resize, the repair, and a later
resize that proves the job whole again.

A kind is an entry of RESIZE_FAULTS: a function `kind(phase)` that, like a resize kind (bench/resizes.py),
changes the job's shards and returns a Resize, or None when it cannot happen now (tried again later in the
round). The soak draws these kinds with the others, each once per round:

  driver-killed     `ps-admin resize` (lease LEASE_SECONDS) adds a shard or removes the last one, and is
                    SIGKILLed once the hold is set (sync: ps 0's GetLayout hold_from_step) or a variable was
                    exported (async: a source shard's GetLayout outbox). Once its lease runs out ps 0 shows the
                    resize cut off (and a sync job's hold has ended by itself); the soak repairs it by
                    `ps-admin resize --resume`, `--abort`, or the chief started again (which rolls it back),
                    in turn (REPAIRS)
  import-refused    a shard started with --max-memory below one variable is added: its import is refused
                    (RESOURCE_EXHAUSTED), so `ps-admin resize` must roll the resize back and say so (exit 1);
                    the shard is then stopped
  importer-killed   a shard is added and SIGKILLed once it holds a variable the resize imported; its driver
                    (`ps-admin resize --connect-timeout CONNECT_SECONDS`) cannot roll back without it, so the
                    resize is left cut off (or was rolled back); the shard is started again (its journal
                    replays) and the resize resumed, aborted or rolled back by the chief, in turn
  save-during-move  the chief saves a checkpoint (the soak's admin client, as the chief's Checkpointer does)
                    once a shard resize has planned its moves: the save commits, every variable of the job in
                    exactly one shard file, or is refused (CheckpointError); never a checkpoint missing one

When a kill comes too late (the driver finished first) the resize is recorded as the plain kind it was
(shard-added, shard-removed) and the fault kind is tried again later in the round. A resize that raised or
was cut off is a failure (`resizes_failed`); it is recovered (`resizes_recovered`) once a later resize of
the job succeeds: the next shard resize drawn, or one the phase runs at the end of its chaos (`settle`).
After every failure the soak takes the job's shards from ps 0's layout (a rollback may keep an added shard
that took a variable in) and stops a shard past them. Every wait has a deadline: a driver that does not end,
a resize not cut off in time, a repair that does not end, each is a hang.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from resizes import MAX_SHARDS, MIN_SHARDS, Resize

__all__ = ["RESIZE_FAULTS", "REPAIRS", "Failure", "Watch", "settle", "checkpoint_problems"]

LEASE_SECONDS = 3.0          # a failing resize's lease (ps-admin --lease-seconds): cut off this long after its driver dies
CONNECT_SECONDS = 3.0        # importer-killed's driver gives up on its dead importer after this (ps-admin --connect-timeout)
MEMORY_LIMIT = 64 << 10      # import-refused's shard (--max-memory): below any counter (bench/soak.py's SLOTS float32s)
ADMIN_SECONDS = 180.0        # a ps-admin run, and a chief's rollback, must end within this
WATCH_SECONDS = 60.0         # a resize must reach the point a fault waits for (its hold, an export, an import) in this
CUT_OFF_SECONDS = 30.0       # past its lease, ps 0 must show a resize whose driver died cut off within this
POLL_SECONDS = 0.0           # between two looks at a resize under way (each look is a few gRPC calls, a few ms)
REPAIRS = ("resume", "abort", "chief")  # a cut-off resize's repairs, taken in turn


@dataclasses.dataclass
class Failure:
    """A resize that raised or was cut off, and what became of it."""

    kind: str
    what: str
    how: str                    # "cut off", or "raised: <ps-admin's message>"
    repair: str = "none"        # a cut-off one's: "resume", "abort", "chief" ("resume, then abort": the first
                                # failed); else "rolled back by its driver" (or "finished by")
    repaired: bool = False      # ps 0's record says it ended (done or aborted) after the repair
    recovered: bool = False     # a later resize of the job succeeded
    cut_off: tuple[float, float] | None = None  # (driver gone, repair begun), CLOCK_MONOTONIC

    def figures(self) -> dict:
        return {**dataclasses.asdict(self), "cut_off": list(self.cut_off) if self.cut_off else None}


class Watch:
    """Raw calls (the chief's token) to the soak's shards on their own ports, not through the proxy: a
    resize under way is watched closely. One channel per shard, closed with the watch."""

    def __init__(self, phase):
        import grpc
        from torchps.security import TOKEN_METADATA_KEY

        self._grpc, self._phase = grpc, phase
        self._metadata = ((TOKEN_METADATA_KEY, phase.security("worker").call_token()),)
        self._channels: dict[int, object] = {}

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc) -> None:
        for channel in self._channels.values():
            channel.close()

    def _stub(self, index: int):
        from torchps.proto import ps_pb2_grpc

        if index not in self._channels:
            self._channels[index] = self._grpc.insecure_channel(f"127.0.0.1:{self._phase.shards.ports[index]}")
        return ps_pb2_grpc.ParameterServerStub(self._channels[index])

    def _call(self, index: int, method: str, request):
        try:
            return getattr(self._stub(index), method)(request, timeout=5, metadata=self._metadata)
        except self._grpc.RpcError:
            return None

    def layout(self, index: int):
        from torchps.proto import ps_pb2

        return self._call(index, "GetLayout", ps_pb2.LayoutRequest())

    def record(self):
        """ps 0's record of the last resize, or None if ps 0 does not answer."""
        from torchps.proto import ps_pb2

        return self._call(0, "Resize", ps_pb2.ResizeRequest(action=ps_pb2.ResizeRequest.GET))

    def held(self, index: int) -> list[str] | None:
        from torchps.proto import ps_pb2

        listed = self._call(index, "ListVariables", ps_pb2.ListRequest())
        return None if listed is None else [info.spec.name for info in listed.variables]


def _until(condition: Callable[[], object], seconds: float, every: float = POLL_SECONDS) -> bool:
    """Whether `condition()` held within `seconds` (looked at every `every` s)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def _target(phase, *, add: bool | None = None) -> tuple[list[str], str, str]:
    """(the shards after, the plain kind, what) of a shard resize: a shard added (started now, empty) or the
    last one removed, at random where both may happen; `add` forces one (an impossible one: ([], "", ""))."""
    shards = phase.live_shards
    can_add, can_remove = len(shards) < MAX_SHARDS, len(shards) > MIN_SHARDS
    if add is None:
        add = can_add and (not can_remove or phase.rng.random() < 0.5)
    if (add and not can_add) or (not add and not can_remove):
        return [], "", ""
    if add:
        return [*shards, phase.add_shard(len(shards))], "shard-added", f"ps {len(shards)}"
    return shards[:-1], "shard-removed", f"ps {len(shards) - 1}"


def _plain(phase, kind: str, what: str, began: float) -> None:
    """A resize a fault came too late for (it succeeded): recorded as its plain kind."""
    phase.resizes.append(Resize(kind, f"{what} (the fault came after its end)", began, time.monotonic()))
    phase.follow_layout()
    phase.resize_succeeded()


def _admin_result(phase, run) -> tuple[int | None, str]:
    """(exit code, output) of a ps-admin run once it ended (ADMIN_SECONDS, else a hang: killed, code None)."""
    proc, out = run
    code = phase.await_exit(proc, ADMIN_SECONDS, f"ps-admin {' '.join(proc.args[-6:])} did not end within "
                                                 f"{ADMIN_SECONDS:g} s")
    return code, out.read_text(errors="replace").strip()


def _last_phase(phase) -> str | None:
    """ps 0's record's phase, in lower case ("running", "done", "aborted"), or None if ps 0 does not answer."""
    with Watch(phase) as watch:
        record = watch.record()
    return None if record is None else record.Phase.Name(record.phase).lower()


def _running(watch: Watch) -> bool | None:
    """Whether ps 0 records a resize running (None: ps 0 does not answer)."""
    record = watch.record()
    return None if record is None else record.phase == record.RUNNING


def _repair(phase, failure: Failure) -> None:
    """Repairs a resize ps 0 shows cut off (once its lease ran out): the next of phase.repairs, then, should
    that one fail (a resume or abort that took the resize over and raised holds it until its own lease runs
    out), the others in turn. Then the shards are taken from ps 0's layout (phase.follow_layout)."""
    with Watch(phase) as watch:
        def cut_off_or_ended() -> bool:
            record = watch.record()
            return record is not None and (record.phase != record.RUNNING or record.lease_left_seconds == 0)

        first = next(phase.repairs)
        for how in ("", first, *(r for r in REPAIRS if r != first)):
            if not _until(cut_off_or_ended, LEASE_SECONDS + CUT_OFF_SECONDS, 0.05):
                phase.hangs.append(f"{failure.kind} ({failure.what}): ps 0 did not show the resize cut off within "
                                   f"{LEASE_SECONDS + CUT_OFF_SECONDS:g} s")
                break
            if not _running(watch):
                break
            if not how:  # cut off: a sync job's hold has ended by itself (the job trains), then the repairs
                if phase.mode == "sync" and not any((layout := watch.layout(s)) is None or layout.outbox
                                                    for s in range(len(phase.live_shards))):
                    since = time.monotonic()
                    if not _until(lambda: phase.trained_since(since), CUT_OFF_SECONDS, 0.05):
                        phase.hangs.append(f"{failure.kind} ({failure.what}): the sync job did not train within "
                                           f"{CUT_OFF_SECONDS:g} s of its resize being cut off (its hold's lease "
                                           f"ran out)")
                failure.cut_off = (failure.cut_off[0] if failure.cut_off else time.monotonic(), time.monotonic())
                continue
            failure.repair = how if failure.repair == "none" else f"{failure.repair}, then {how}"
            if how == "chief":  # it rolls a cut-off resize back as it starts (worker.chief.repair_resize)
                phase.restart_chief()
                if not _until(lambda: _running(watch) is False, ADMIN_SECONDS, 0.1):
                    phase.hangs.append(f"{failure.kind} ({failure.what}): the chief started again did not roll "
                                       f"the cut-off resize back within {ADMIN_SECONDS:g} s")
                continue
            code, out = _admin_result(phase, phase.start_admin(["resize", f"--{how}", "--lease-seconds",
                                                                str(LEASE_SECONDS)]))
            if code not in (0, None):
                phase.failures.append(f"{failure.kind} ({failure.what}): ps-admin resize --{how} ended with code "
                                      f"{code}: {out[-500:]}")
        if failure.repair == "none":
            failure.repair = {"done": "finished by its driver", "aborted": "rolled back by its driver"}.get(
                _last_phase(phase), "none")
        failure.repaired = _running(watch) is False
    phase.follow_layout()


def driver_killed(phase) -> Resize | None:
    """ps-admin resizes the job (a shard added or the last removed) and is killed once its hold is set
    (sync) or a variable was exported (async); the cut-off resize is then repaired."""
    began = time.monotonic()
    addresses, plain, what = _target(phase)
    if not addresses:
        return None
    sources = range(len(phase.live_shards)) if plain == "shard-added" else [len(phase.live_shards) - 1]
    run = phase.start_admin(["resize", "--ps", ",".join(addresses), "--lease-seconds", str(LEASE_SECONDS)])
    with Watch(phase) as watch:
        def moving() -> bool:
            if phase.mode == "sync":
                layout = watch.layout(0)
                return layout is not None and layout.hold_from_step > 0
            return any((layout := watch.layout(s)) is not None and len(layout.outbox) > 0 for s in sources)

        _until(lambda: run[0].poll() is not None or moving(), WATCH_SECONDS)
    if run[0].poll() is None:
        run[0].kill()
    code, out = _admin_result(phase, run)
    if code == 0 or _last_phase(phase) == "done":  # killed too late: after it ended
        _plain(phase, plain, what, began)
        return None
    failure = Failure("driver-killed", f"{plain} {what}", "cut off" if code == -9 else f"raised: {out[-300:]}",
                      cut_off=(time.monotonic(), time.monotonic()))
    phase.resize_failures.append(failure)
    _repair(phase, failure)
    return Resize("driver-killed", f"{plain} {what}, {failure.repair}", began, time.monotonic())


def import_refused(phase) -> Resize | None:
    """Adds a shard whose --max-memory refuses any variable: ps-admin must roll the resize back and say so."""
    if len(phase.live_shards) >= MAX_SHARDS:
        return None
    began = time.monotonic()
    index = len(phase.live_shards)
    address = phase.add_shard(index, ["--max-memory", str(MEMORY_LIMIT)])
    code, out = _admin_result(phase, phase.start_admin(
        ["resize", "--ps", ",".join([*phase.live_shards, address]), "--lease-seconds", str(LEASE_SECONDS)]))
    if code == 0:
        phase.failures.append(f"import-refused: a resize onto ps {index} (--max-memory {MEMORY_LIMIT}) succeeded")
        _plain(phase, "shard-added", f"ps {index}", began)
        return None
    failure = Failure("import-refused", f"ps {index}", f"raised: {out[-300:]}")
    phase.resize_failures.append(failure)
    if code is not None and not ("ResourceExhaustedError" in out and "rolled back" in out):
        phase.failures.append(f"import-refused: ps-admin did not report the refused import rolled back (code "
                              f"{code}): {out[-500:]}")
    _repair(phase, failure)
    return Resize("import-refused", f"ps {index}", began, time.monotonic())


def importer_killed(phase) -> Resize | None:
    """Adds a shard and kills it once it holds an imported variable; it is started again (its journal) and
    the resize, cut off or rolled back by its driver, repaired."""
    if len(phase.live_shards) >= MAX_SHARDS:
        return None
    began = time.monotonic()
    addresses, _, what = _target(phase, add=True)
    index = len(addresses) - 1
    run = phase.start_admin(["resize", "--ps", ",".join(addresses), "--lease-seconds", str(LEASE_SECONDS),
                             "--connect-timeout", str(CONNECT_SECONDS)])
    with Watch(phase) as watch:
        _until(lambda: run[0].poll() is not None or watch.held(index), WATCH_SECONDS)
    ended_first = run[0].poll() is not None
    phase.shards.kill_ps(index)
    code, out = _admin_result(phase, run)
    phase.shards.start_ps(index)  # its journal replays what it took in
    if code == 0:
        _plain(phase, "shard-added", what, began)
        return None
    failure = Failure("importer-killed", what, f"raised: {out[-300:]}" + (" (before the kill)" if ended_first else ""),
                      cut_off=(time.monotonic(), time.monotonic()))
    phase.resize_failures.append(failure)
    _repair(phase, failure)
    return Resize("importer-killed", f"{what}, {failure.repair}", began, time.monotonic())


def save_during_move(phase) -> Resize | None:
    """A shard resize (added or removed) with a checkpoint saved once its moves are planned: committed with
    every variable once, or refused."""
    from torchps.client import CheckpointError, PSClient, PSError

    began = time.monotonic()
    addresses, plain, what = _target(phase)
    if not addresses:
        return None
    resize = threading.Thread(target=phase.resize_shards, args=(addresses,), daemon=True)
    resize.start()
    with Watch(phase) as watch:
        def planned() -> bool:
            record = watch.record()
            return record is not None and record.phase == record.RUNNING and (len(record.moves) > 0
                                                                              or record.hold_from_step > 0)

        _until(lambda: not resize.is_alive() or planned(), WATCH_SECONDS)
    during = resize.is_alive()
    with PSClient(phase.cluster, connect_timeout=30, security=phase.security("worker")) as chief:
        chief.declare(phase.declared())
        try:
            step = chief.save_checkpoint(0, keep=2, timeout=120)
        except CheckpointError as exc:
            phase.saves["refused" if during else "refused after the move"] += 1
            phase.save_lines.append(f"refused: {exc}"[:300])
        except PSError as exc:
            phase.failures.append(f"save-during-move: the save failed: {type(exc).__name__}: {exc}"[:500])
        else:
            phase.saves["committed" if during else "committed after the move"] += 1
            phase.checkpoint_problems += checkpoint_problems(phase.ckpt, step, [n for n, _ in phase.declared()])
    resize.join(ADMIN_SECONDS)
    if resize.is_alive():
        phase.hangs.append(f"save-during-move: the resize ({plain} {what}) did not end within {ADMIN_SECONDS:g} s")
    return Resize("save-during-move", f"{plain} {what}", began, time.monotonic())


def settle(phase) -> None:
    """At the end of a phase's chaos: a failure no later resize recovered yet gets one now (a shard added, or
    the last removed), which must succeed."""
    if any(not f.recovered for f in phase.resize_failures):
        began = time.monotonic()
        addresses, plain, what = _target(phase)
        phase.resize_shards(addresses)  # a success recovers every failure before it
        phase.resizes.append(Resize(plain, f"{what} (after the failures)", began, time.monotonic()))


def checkpoint_problems(ckpt, step: int, names: list[str]) -> list[str]:
    """What is wrong with committed checkpoint `step`: a variable of `names` not in exactly one of its shard
    files (among their variables or in their outboxes); [] if nothing, or if a newer save pruned it first."""
    import json

    from torchps.ps_server.checkpoint import MANIFEST, held_entries, load, step_dir

    folder = step_dir(ckpt, step)
    where: dict[str, list[int]] = {}
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        for shard in manifest["shards"]:
            for entry in held_entries(load(folder / shard["file"], mmap=True)):
                where.setdefault(entry["name"], []).append(shard["index"])
    except Exception as exc:  # noqa: BLE001 - a file missing or unreadable, whatever torch raises
        return [] if not folder.exists() else [f"checkpoint {step} cannot be read: {exc}"[:300]]
    return [f"checkpoint {step}: {name} is in the files of ps {where.get(name, [])}" for name in names
            if len(where.get(name, [])) != 1]


RESIZE_FAULTS: dict[str, Callable[[object], Resize | None]] = {
    "driver-killed": driver_killed,
    "import-refused": import_refused,
    "importer-killed": importer_killed,
    "save-during-move": save_during_move,
}
