"""The chaos soak's short variant (bench/soak.py --minutes 0.5): kills, pauses, cut connections, full disks, a hostile
evaluator and a structural optimizer change while four workers push, and workers added (under names past the
starting spec, their tokens minted while the shards run) and removed, shards added and removed live (in both
phases), then the audit: nothing acknowledged lost,
nothing applied twice, no hang, no wedged shard, a shard that stopped itself for every full disk, no far min_step
answered, no optimizer change accepted, a complete final checkpoint that restores exactly. Every fault kind and
every resize kind must have happened in each run, each resize with its measured pause.

A phase goes on past its time until every kind of fault was injected once, so each kind happens and is audited, with
both phases training between faults (over 100 acknowledged pushes each). The suite draws the pause between two
events from 0.5-1.25 s instead of the soak's 2-5 s (FAULT_EVERY) and gives each phase 15 s: a phase is then as long
as its 12 kinds take (the events themselves, a shard's restart or a resize, outlast the pauses), and every kind
still happens with training between them (a resize waits for every worker to have trained first; the asserts below
check over 100 acknowledged pushes per phase). Denser faults with a fixed half minute (one every 1-2 s) once starved
the sync phase (22 pushes in 15 s): the phases now go on until every kind happened. The resizes that fail
(bench/resize_faults.py: a driver killed, an import refused, an importer killed, a save during a move) are left out
here (`--kinds`): each waits out a lease and a repair, which would lengthen every phase; the full soak draws them.

The replicated variant (`--replicas 2`, bench/soak_replicas.py) runs one sync phase with the kinds that strike a
shard's primary or backup: kill-shard, host-lost, backup-lost, backup-disk-full and partition-primary, each at
least once, and the shard resizes (a shard added with a backup of its own, then removed with it). Every primary
struck must be taken over by its backup (a push acknowledged by the successor), every partitioned primary must stop
by itself, and the audit must hold as without backups. One phase, not two: the fork server's start and
each phase's own (shards, backups, the final checkpoint restored) would double its time.
"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KINDS = {"kill-worker", "kill-shard", "pause-worker", "pause-shard", "cut-connections", "hostile-evaluator",
         "toggle-optimizer", "disk-full"}
RESIZE_KINDS = {"worker-added", "worker-removed", "shard-added", "shard-removed"}
REPLICA_KINDS = {"kill-shard", "host-lost", "backup-lost", "backup-disk-full", "partition-primary"}
SHARD_RESIZES = {"shard-added", "shard-removed"}
STRIKES = {"kill-shard", "host-lost", "partition-primary"}  # the kinds that take a shard's primary away


@pytest.mark.timeout(660)  # its subprocess may run 600 s
def test_chaos_loses_nothing_duplicates_nothing_and_never_hangs(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "0.5",
                          "--fault-every", "0.5,1.25", "--kinds", ",".join(sorted(KINDS | RESIZE_KINDS)),
                          "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"no results (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    report = json.dumps({k: v for k, v in result.items() if k != "phases"}) + "\n" + run.stdout[-2000:]
    assert set(result["faults_injected"]) == KINDS, f"every kind of fault happened: {report}"
    assert set(result["resizes_by_kind"]) == RESIZE_KINDS, f"every kind of resize happened: {report}"
    events = [event for phase in result["phases"] for event in phase["resize_events"]]
    assert result["resizes"] == len(events) and all(event["pause_s"] >= 0 for event in events), report
    assert result["resize_pause_p99_s"] == max(event["pause_s"] for event in events) or len(events) > 100, report
    added = {event["what"] for event in events if event["kind"] == "worker-added"}
    assert added & {"worker 4", "worker 5"}, f"a name past the starting spec joined: {report}"
    assert all(p["pushes_acked"] > 100 for p in result["phases"]), f"both phases trained: {report}"
    assert (result["lost"], result["duplicated"], result["hangs"], result["worker_failures"]) == (0, 0, 0, 0), report
    assert (result["wedged"], result["hostile_pulls_answered"], result["optimizer_toggles_accepted"]) == (0, 0, 0), \
        report
    assert result["hostile_pulls"] > 0 and result["optimizer_toggles"] > 0, report
    assert result["failstops"] == result["faults_injected"]["disk-full"], report
    assert result["checkpoint_complete"], report + "\n" + json.dumps([p["checkpoint_detail"] for p in result["phases"]])
    assert [p["mode"] for p in result["phases"]] == ["async", "sync"]
    assert result["phases"][1]["sync_steps_applied_once"] is True, report
    assert set(result["phases"][1]["resizes_by_kind"]) == RESIZE_KINDS, f"the sync job resized its shards: {report}"
    for phase in result["phases"]:  # the timeline the soak's benchmark page draws: every event, in its phase
        timeline = phase["timeline"]
        assert len(timeline["faults"]) == sum(phase["faults_injected"].values()), timeline
        assert len(timeline["resizes"]) == phase["resizes"], timeline
        assert all(0 <= began <= ended <= phase["seconds"] for began, ended, _ in timeline["resizes"]), timeline
        assert sum(timeline["acked_per_second"]) == phase["pushes_acked"], (timeline, phase["pushes_acked"])
    assert run.returncode == 0, report


@pytest.mark.timeout(660)  # its subprocess may run 600 s
def test_replicated_shards_fail_over_under_chaos_and_lose_nothing(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--replicas", "2", "--modes", "sync",
                          "--minutes", "0.2", "--fault-every", "0.5,1.25", "--kinds",
                          ",".join(sorted(REPLICA_KINDS | SHARD_RESIZES)),
                          "--json", str(out), "--keep", str(tmp_path / "kept")],  # every log, for a failure's cause
                         capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"no results (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    report = json.dumps({k: v for k, v in result.items() if k != "phases"}) + "\n" + run.stdout[-2000:]
    faults = result["faults_injected"]
    assert set(faults) == REPLICA_KINDS, f"every kind happened: {report}"
    assert set(result["resizes_by_kind"]) == SHARD_RESIZES and result["resizes_failed"] == 0, report
    assert (result["lost"], result["duplicated"], result["hangs"], result["worker_failures"]) == (0, 0, 0, 0), report
    assert (result["wedged"], result["shard_crashes"], result["failstops"]) == (0, 0, 0), report
    assert result["pushes_acked"] > 100, f"the job trained: {report}"
    failovers = result["failovers"]
    struck = sorted(kind for kind, times in faults.items() if kind in STRIKES for _ in range(times))
    assert sorted(f["kind"] for f in failovers) == struck, f"each primary struck failed over once: {report}"
    assert result["failovers_unserved"] == 0 and all(f["failover_s"] > 0 for f in failovers), report
    assert result["failover_p99_s"] == max(f["failover_s"] for f in failovers), report
    assert all(0 < f["promoted_s"] < f["failover_s"] for f in failovers), f"each grant came between: {report}"
    assert result["promotion_p99_s"] == max(f["promoted_s"] for f in failovers), report
    assert result["fenced"] == faults["partition-primary"], f"every partitioned primary stopped itself: {report}"
    assert result["fresh_backups"] == faults["host-lost"], report
    assert result["checkpoint_complete"], report + "\n" + json.dumps(result["phases"][0]["checkpoint_detail"])
    assert result["phases"][0]["sync_steps_applied_once"] is True, report
    assert run.returncode == 0, report
