"""Checkpoints, restores, re-layout, export and shutdown against real ps-server processes.

Tests that save or kill shards start their own LocalCluster (with
`--checkpoint-dir` where they save); files are read back with torch.load, as a
user would, and compared with what the shards served. Every wait is bounded,
so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import json
import pathlib
import signal
import sys
import threading
import time
from concurrent import futures

import pytest
import torch

from torchps.client import (CheckpointError, InvalidArgumentError, ModeConflictError, Optimizer, PSClient,
                            TaskSpec)
from torchps.proto import ps_pb2
from torchps.client.transfer import push_requests
from torchps.worker.chief import Checkpointer
from torchps.ps_server.checkpoint import latest_committed
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import sync_workers  # noqa: E402 - needs the path above under any import mode
from helpers import wait_until

EXIT_TIMEOUT = 10.0  # "exits within a few seconds"


def step_dir(directory: pathlib.Path, step: int) -> pathlib.Path:
    return directory / f"step-{step:012d}"


def load_shard(directory: pathlib.Path, step: int, index: int) -> dict:
    path = step_dir(directory, step) / f"ps-{index}.pt"
    assert path.is_file(), f"no {path.name} for step {step}; the folder holds " \
                           f"{sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else 'nothing'}"
    return torch.load(path, map_location="cpu", weights_only=True)


def saved_steps(directory: pathlib.Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in directory.glob("step-*") if p.is_dir())


def by_name(state: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in state["variables"]}


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(expected), f"{what}: names {sorted(got)} != {sorted(expected)}"
    for name, value in expected.items():
        assert torch.equal(got[name], value), \
            f"{what}: {name!r} differs (max abs diff {(got[name] - value).abs().max().item():.3g})"


def kill_and_restart(local: LocalCluster, *indices: int) -> None:
    """SIGKILLs these shards, then starts them again with the same index and port, concurrently."""
    assert [local.kill_ps(i) for i in indices] == [-signal.SIGKILL] * len(indices)
    with futures.ThreadPoolExecutor(len(indices)) as pool:
        list(pool.map(local.start_ps, indices))


SHAPES = {"w0": (5, 3), "w1": (7,), "w2": (2, 2), "w3": (3,)}  # round robin: w0, w2 on ps 0; w1, w3 on ps 1


# -- save, files, exact restore -------------------------------------------------------------------------

NO_JOURNAL = ["--no-journal"]  # a restart then falls back to the newest committed checkpoint


def test_save_writes_every_shard_and_a_manifest_and_a_restart_restores_values_versions_and_adam_state(tmp_path):
    """save_checkpoint(0): step-N/ps-I.pt for every shard, then manifest.json (committed), holding exactly what
    the shards served; after SIGKILL + restart of both shards (no journal) the next Adam update equals the
    uninterrupted one."""
    ckpt = tmp_path / "ckpt"
    with LocalCluster(2, server_args=["--checkpoint-dir", str(ckpt), *NO_JOURNAL]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        client.create_variables(random_tensors(SHAPES, seed=0), Optimizer("adam", lr=0.01, betas=(0.8, 0.9)))
        for k in range(3):
            client.push(random_tensors(SHAPES, seed=10 + k))
        step = client.save_checkpoint(0)
        assert step == 3, "save_checkpoint(0) saves the state now: 3 pushes, step 3"

        at_save = client.pull(list(SHAPES))
        versions = {info.spec.name: info.version for info in client.list_variables()}
        assert versions == {name: 3 for name in SHAPES}
        assert sorted(p.name for p in step_dir(ckpt, 3).iterdir()) == ["manifest.json", "ps-0.pt", "ps-1.pt"]
        manifest = json.loads((step_dir(ckpt, 3) / "manifest.json").read_text())
        assert manifest["format"] == "torchps-checkpoint-v2" and manifest["step"] == 3
        assert manifest["num_ps"] == 2 and manifest["strategy"] == "round_robin"
        assert [s["file"] for s in manifest["shards"]] == ["ps-0.pt", "ps-1.pt"]
        assert [s["bytes"] for s in manifest["shards"]] == [(step_dir(ckpt, 3) / f"ps-{i}.pt").stat().st_size
                                                            for i in (0, 1)]
        assert [name for name, _ in manifest["variables"]] == list(SHAPES), "creation order"
        assert [nbytes for _, nbytes in manifest["variables"]] == [4 * torch.Size(s).numel() for s in SHAPES.values()]
        for index, names in ((0, ["w0", "w2"]), (1, ["w1", "w3"])):
            state = load_shard(ckpt, 3, index)
            assert state["step"] == 3 and state["index"] == index and state["format"] == "torchps-shard-v2"
            entries = by_name(state)
            assert list(entries) == names, f"ps {index} holds its own variables, in creation order"
            assert_same({n: e["value"] for n, e in entries.items()}, {n: at_save[n] for n in names},
                        f"ps-{index}.pt values")
            for name, entry in entries.items():
                assert entry["version"] == versions[name]
                assert entry["optimizer"] == "adam" and entry["hyperparams"]["beta1"] == pytest.approx(0.8)
                moments = entry["optimizer_state"]["state"][0]
                assert {"exp_avg", "exp_avg_sq", "step"} <= set(moments), moments.keys()
                assert float(moments["step"]) == 3 and moments["exp_avg"].abs().sum() > 0
            assert [r["seq"] for r in state["ledger"]] == [3], "the push ledger travels in the checkpoint"

        nxt = random_tensors(SHAPES, seed=99)
        client.push(nxt)
        uninterrupted = client.pull(list(SHAPES))  # what a shard that never died computes next

        kill_and_restart(local, 0, 1)
        for index in (0, 1):
            status = client.status(index)
            assert (status.restored_step, status.step, status.num_variables) == (3, 3, 2), status
        assert_same(client.pull(list(SHAPES)), at_save, "values after the restart")
        assert {i.spec.name: i.version for i in client.list_variables()} == versions, "versions after the restart"
        client.push(nxt)
        assert_same(client.pull(list(SHAPES)), uninterrupted,
                    "the first update after the restart (Adam moments and step count restored)")


def test_keep_prunes_older_committed_checkpoints(tmp_path):
    """keep=K leaves the K newest committed checkpoints; the newest committed one is never removed."""
    ckpt = tmp_path / "ckpt"
    names = ["a", "b", "c"]  # one per shard
    with LocalCluster(3, server_args=["--checkpoint-dir", str(ckpt)]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        client.create_variables({n: torch.zeros(3) for n in names}, Optimizer("sgd", lr=1.0))
        for k in range(1, 6):
            client.push({n: -torch.ones(3) for n in names})
            assert client.save_checkpoint(0, keep=2) == k
            assert saved_steps(ckpt) == list(range(max(1, k - 1), k + 1)), f"after save {k}"
        for step in (4, 5):
            assert sorted(p.name for p in step_dir(ckpt, step).iterdir()) == \
                ["manifest.json", "ps-0.pt", "ps-1.pt", "ps-2.pt"]
        assert float(load_shard(ckpt, 5, 2)["variables"][0]["value"][0]) == 5


def test_two_saves_of_one_step_at_once_publish_whole_files(tmp_path):
    """Temporary names are unique: concurrent saves of the same step never publish a truncated file."""
    ckpt = tmp_path / "ckpt"
    with LocalCluster(1, server_args=["--checkpoint-dir", str(ckpt)]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        client.create_variables({"big": torch.arange(float(BIG // 4))}, Optimizer("none"))
        with futures.ThreadPoolExecutor(4) as pool:
            steps = list(pool.map(lambda _: client.save_checkpoint(0), range(4)))
        assert steps == [0] * 4
        state = load_shard(ckpt, 0, 0)
        assert torch.equal(by_name(state)["big"]["value"], torch.arange(float(BIG // 4)))
        assert not list(ckpt.rglob("*.tmp")), "no temporary file is left behind"


# -- atomicity: a shard killed while it saves ---------------------------------------------------------

BIG = 16 << 20  # float32 elements: 64 MiB, so writing a shard file takes a while
# what a new client declares to find them: big0, counter0 on ps 0; counter, big on ps 1
PLACED = [("big0", 4 * BIG), ("counter", 16), ("counter0", 16), ("big", 4 * BIG)]


def test_sigkill_during_a_save_never_leaves_a_partial_checkpoint_that_counts(tmp_path):
    """SIGKILL shard 1 while it writes its 64 MiB part of a checkpoint, twice: the save fails and is
    never committed, committed checkpoints stay whole, the restarted shard (no journal) restores the newest
    committed one and deletes its dead predecessor's temporary file; the next commit removes the partial
    folders older than it."""
    ckpt = tmp_path / "ckpt"
    ones = torch.ones(4)
    with LocalCluster(2, server_args=["--checkpoint-dir", str(ckpt), *NO_JOURNAL]) as local:
        with PSClient(local.cluster, connect_timeout=20, partitioner=None) as client:  # the placement PLACED shows
            client.create_variables({"big0": torch.zeros(BIG), "counter": torch.zeros(4)}, Optimizer("sgd", lr=1.0))
            client.create_variables({"counter0": torch.zeros(4), "big": torch.zeros(BIG)}, Optimizer("none"))
            client.push({"counter": -ones})
            assert client.save_checkpoint(0) == 1
        killed_mid_write = 0
        for attempt in range(2):
            with PSClient(local.cluster, connect_timeout=3, partitioner=None) as saver:
                saver.declare(PLACED)
                saver.push({"counter": -ones})
                result: list = []
                thread = threading.Thread(target=lambda: result.append(_save_or_error(saver)), daemon=True)
                thread.start()
                temporaries = lambda: list(ckpt.glob("step-*/.ps-1.pt.*.tmp"))  # noqa: E731
                wait_until(lambda: temporaries() or result, 60, "shard 1 to start writing its file")
                assert local.kill_ps(1) == -signal.SIGKILL
                thread.join(60)
                assert not thread.is_alive(), "the save did not end after its shard died"
                killed_mid_write += bool(temporaries())
            assert isinstance(result[0], Exception), f"attempt {attempt}: a save whose shard died must fail"
            assert latest_committed(ckpt)[0] == 1, "nothing was committed without every shard's file"
            for folder in ckpt.glob("step-*"):
                if (folder / "manifest.json").is_file():
                    assert all(load_shard(ckpt, int(folder.name.removeprefix("step-")), i) for i in (0, 1))
            local.start_ps(1)
            with PSClient(local.cluster, connect_timeout=20) as client:
                client.declare(PLACED)
                assert client.status(1).restored_step == 1
            assert f"restoring {step_dir(ckpt, 1) / 'ps-1.pt'}" in local.log(1)
            assert not temporaries(), "the restarted shard deleted its predecessor's temporary file"
        assert killed_mid_write >= 1, "no kill landed while a file was being written: the test proved nothing"
        with PSClient(local.cluster, connect_timeout=20) as client:
            client.declare(PLACED)
            final = client.save_checkpoint(0)
        assert saved_steps(ckpt) == [1, final], "the commit removed the partial folders older than it"


def _save_or_error(client: PSClient):
    try:
        return client.save_checkpoint(0, keep=3, timeout=60)
    except Exception as exc:  # noqa: BLE001 - the kill makes this save fail; that is the point
        return exc


# -- restart by itself -----------------------------------------------------------------------------

def test_sigkilled_shard_restarted_without_a_journal_restores_its_newest_committed_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    with LocalCluster(2, server_args=["--checkpoint-dir", str(ckpt), *NO_JOURNAL]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        client.create_variables(random_tensors(SHAPES, seed=1), Optimizer("sgd", lr=0.1, momentum=0.9))
        for k in range(2):
            client.push(random_tensors(SHAPES, seed=20 + k))
        assert client.save_checkpoint(0) == 2
        at_save = client.pull(list(SHAPES))
        before = client.status(1)
        assert before.restored_step == -1, "a fresh shard restored nothing"
        for k in range(3):  # updates after the checkpoint: lost on ps 1 when it dies
            client.push(random_tensors(SHAPES, seed=30 + k))
        after_more = client.pull(list(SHAPES))
        assert client.restarts_seen == 0

        (step_dir(ckpt, 7) / "ps-1.pt").parent.mkdir()
        (step_dir(ckpt, 7) / "ps-1.pt").write_bytes(b"a partial checkpoint, newer than the committed one")
        assert local.kill_ps(1) == -signal.SIGKILL
        local.start_ps(1)
        status = client.status(1)
        assert status.generation != before.generation, "a restarted shard reports a new generation"
        assert (status.restored_step, status.step) == (2, 2), status
        assert f"restoring {step_dir(ckpt, 2) / 'ps-1.pt'}" in local.log(1), "never the partial step 7"
        values = client.pull(list(SHAPES))
        assert_same({n: values[n] for n in ("w1", "w3")}, {n: at_save[n] for n in ("w1", "w3")},
                    "ps 1 after its restart (its checkpoint)")
        assert_same({n: values[n] for n in ("w0", "w2")}, {n: after_more[n] for n in ("w0", "w2")},
                    "ps 0, never restarted")

        client.push(random_tensors(SHAPES, seed=40))
        assert client.restarts_seen == 1, "the client notices the new generation on its next push"
        assert client.status(1).step == client.status(0).step == 6, "the restored shard adopts the job's step"


def test_sigkilled_shard_with_its_journal_comes_back_with_everything_it_acknowledged(tmp_path):
    """The default with --checkpoint-dir: the journal. After SIGKILL the shard has every acknowledged update
    (not only the checkpoint's), and a retry of the last push is not applied again."""
    ckpt = tmp_path / "ckpt"
    with LocalCluster(2, server_args=["--checkpoint-dir", str(ckpt)]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        client.create_variables(random_tensors(SHAPES, seed=1), Optimizer("adam", lr=0.1))
        client.push(random_tensors(SHAPES, seed=2))
        client.save_checkpoint(0)
        for k in range(3):
            client.push(random_tensors(SHAPES, seed=30 + k))
        acknowledged = client.pull(list(SHAPES))
        kill_and_restart(local, 0, 1)
        assert_same(client.pull(list(SHAPES)), acknowledged, "after the restart")
        assert [client.status(i).step for i in (0, 1)] == [4, 4]
        assert "recovered from the journal" in local.log(1)
        header = client._header(None, True)  # the last push again, as a retry would send it
        header.seq -= 1
        for shard in (0, 1):
            names = [n for n in SHAPES if client.placement.shard_of(n) == shard]
            reply = client._fanout.channels.stubs[shard].Push(push_requests(
                header, random_tensors(SHAPES, seed=32), names, client.chunk_bytes), timeout=20)
            assert reply.duplicate, f"ps {shard} knows the last push after its restart"
        assert_same(client.pull(list(SHAPES)), acknowledged, "a retried push changed nothing")


# -- step consistency under sync training ---------------------------------------------------------------

def test_saves_during_sync_training_are_step_consistent(tmp_path):
    """2 sync workers (threads with their own PSClients) train while the chief calls save_checkpoint():
    every shard's file of a saved step holds that step, and together they are the state at that step."""
    ckpt = tmp_path / "ckpt"
    num_workers, batch = 2, 4
    x, y = sync_workers.make_data(20, num_workers * batch)
    with LocalCluster(2, workers=num_workers, server_args=["--checkpoint-dir", str(ckpt)]) as local:
        clients = [PSClient(local.cluster, task=TaskSpec("worker", i), connect_timeout=20) for i in range(2)]
        try:
            clients[0].configure("sync", total_num_replicas=2, replicas_to_aggregate=2, lease_seconds=10.0)
            models = [sync_workers.make_model() for _ in range(2)]
            bindings = [None, None]
            history: dict[int, dict[str, torch.Tensor]] = {}  # worker 0's pulls: the state at each step
            stop, errors = threading.Event(), []
            ready = threading.Barrier(3)

            def train(index: int) -> None:
                try:
                    bindings[index] = binding = clients[index].register_module(
                        models[index], Optimizer("sgd", lr=0.05, momentum=0.9), create=index == 0, wait_timeout=30)
                    if index == 0:
                        history[binding.step] = {n: p.detach().clone() for n, p in binding.params.items()}
                    ready.wait(30)
                    rows = slice(index * batch, (index + 1) * batch)
                    k = 0
                    while not stop.is_set() and k < 5000:
                        sync_workers.backward(models[index], x[k % len(x), rows], y[k % len(x), rows])
                        binding.push()
                        binding.pull()
                        if index == 0:
                            history[binding.step] = {n: p.detach().clone() for n, p in binding.params.items()}
                        k += 1
                    clients[index].leave()
                except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                    errors.append(exc)
                    stop.set()

            threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(2)]
            for thread in threads:
                thread.start()
            ready.wait(60)
            saved = []
            for _ in range(3):  # each save asks for a step training has not reached yet
                saved.append(clients[0].save_checkpoint(keep=10, timeout=60))
                wait_until(lambda: max(history) > saved[-1] + 2 or errors, 30, "training to go past the save")
            stop.set()
            for thread in threads:
                thread.join(30)
            assert not errors, f"a training thread failed: {errors[0]!r}"
            assert not any(t.is_alive() for t in threads), "training threads hung"
        finally:
            for client in clients:
                client.close()

    assert saved == sorted(set(saved)) and saved[0] > 0, f"three distinct saves during training: {saved}"
    for step in saved:
        assert step in history, f"step {step} was never reached by worker 0 ({min(history)}..{max(history)})"
        states = [load_shard(ckpt, step, i) for i in (0, 1)]
        assert [s["step"] for s in states] == [step, step]
        assert json.loads((step_dir(ckpt, step) / "manifest.json").read_text())["step"] == step, "committed"
        entries = {**by_name(states[0]), **by_name(states[1])}
        assert_same({n: e["value"] for n, e in entries.items()}, history[step], f"the checkpoint of step {step}")
        assert {n: e["version"] for n, e in entries.items()} == {n: step for n in history[step]}, \
            "one update per variable and step"
        assert states[0]["config"]["mode"] == "sync"


# -- export ---------------------------------------------------------------------------------------------

def test_export_state_dict_loads_into_a_fresh_module_with_the_same_outputs(client, tmp_path):
    model = sync_workers.make_model(seed=0)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    binding = client.register_module(model, Optimizer("sgd", lr=0.1), create=True, prefix="export/", join=False)
    x, y = sync_workers.make_data(5, 16)
    for k in range(5):
        sync_workers.backward(model, x[k], y[k])
        binding.push()
        binding.pull()
    path = tmp_path / "model.pt"
    torch.save(client.export_state_dict(binding.names, strip_prefix="export/"), path)

    fresh = sync_workers.make_model(seed=123)
    fresh.load_state_dict(torch.load(path, weights_only=True))  # strict: every key, no extra
    assert not torch.equal(fresh[0].weight, initial["0.weight"]), "the export holds the trained values"
    with torch.no_grad():
        probe = torch.randn(32, sync_workers.IN)
        assert torch.equal(fresh(probe), model(probe)), "the exported model computes what the trained one does"
    assert_same({n: p.detach() for n, p in fresh.named_parameters()},
                {n.removeprefix("export/"): v for n, v in client.pull(binding.names).items()}, "the exported values")


# -- re-layout ------------------------------------------------------------------------------------------

def make_deep_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 3))  # 6 variables: 3 shards get 2 each, 2 shards 3 each


def test_relayout_onto_3_and_onto_1_shards_serves_the_same_values_and_training_continues(tmp_path):
    source = tmp_path / "two-shards"
    optimizer = Optimizer("sgd", lr=0.1, momentum=0.9)
    with LocalCluster(2, server_args=["--checkpoint-dir", str(source)]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        model = make_deep_model(seed=0)
        binding = client.register_module(model, optimizer, create=True, join=False)
        shapes = {n: tuple(p.shape) for n, p in binding.params.items()}
        for k in range(3):
            client.push(random_tensors(shapes, seed=50 + k))
        saved_step = client.save_checkpoint(0)
        saved = client.pull(binding.names)
        nxt = random_tensors(shapes, seed=60)
        client.push(nxt)
        uninterrupted = client.pull(binding.names)  # the next update with the momentum buffers intact

    for num_ps in (3, 1):
        new_dir = tmp_path / f"{num_ps}-shards"
        new_dir.mkdir()  # an empty --checkpoint-dir: --restore-from applies
        args = ["--restore-from", str(source), "--num-ps", str(num_ps), "--checkpoint-dir", str(new_dir)]
        with LocalCluster(num_ps, server_args=args) as local, PSClient(local.cluster, connect_timeout=20) as client:
            fresh = make_deep_model(seed=num_ps)  # other initial values: they must not win
            binding = client.register_module(fresh, optimizer, create=True, join=False)
            assert_same({n: p.detach().clone() for n, p in binding.params.items()}, saved,
                        f"{num_ps} shards: the module after register_module")
            for index in range(num_ps):
                status = client.status(index)
                assert (status.restored_step, status.step) == (saved_step, saved_step), status
                assert status.num_variables == 6 // num_ps, f"ps {index} of {num_ps}: {status.num_variables} variables"
            client.push(nxt)
            assert_same(client.pull(binding.names), uninterrupted,
                        f"{num_ps} shards: the first update after the re-layout (momentum restored)")
            x, y = torch.randn(8, 10), torch.randn(8, 3)
            before = client.pull(binding.names)
            for _ in range(3):
                binding.pull()
                fresh.zero_grad()
                torch.nn.functional.mse_loss(fresh(x), y).backward()
                binding.push()
            after = client.pull(binding.names)
            assert all(not torch.equal(after[n], before[n]) for n in before), "training goes on"
            assert client.global_step() == saved_step + 4
            step = client.save_checkpoint(0)
            manifest = json.loads((step_dir(new_dir, step) / "manifest.json").read_text())
            assert manifest["num_ps"] == num_ps
            assert sorted(p.name for p in step_dir(new_dir, step).glob("ps-*.pt")) == \
                [f"ps-{i}.pt" for i in range(num_ps)]


# -- shutdown, missing directory, end of job -------------------------------------------------------------

def test_idle_shards_keep_running_and_shutdown_cluster_ends_them_with_code_0():
    with LocalCluster(2) as local:
        with PSClient(local.cluster, connect_timeout=20) as client:
            assert [client.status(i).index for i in (0, 1)] == [0, 1], "idle shards serve"
            assert [p.poll() for p in local.procs] == [None, None]
            client.shutdown_cluster()
            started = time.monotonic()
            codes = [proc.wait(timeout=EXIT_TIMEOUT) for proc in local.procs]
        assert codes == [0, 0], f"exit codes after Shutdown: {codes}"
        assert time.monotonic() - started < EXIT_TIMEOUT
        for index in (0, 1):
            assert "shutdown requested" in local.log(index)


def test_save_without_checkpoint_dir_is_a_mode_conflict_naming_the_flag(client):
    client.create_variables({"nodir/v": torch.zeros(2)})
    with pytest.raises(ModeConflictError, match="--checkpoint-dir"):
        client.save_checkpoint(0)


def test_checkpointer_stop_does_not_wait_for_a_step_the_finished_job_never_reaches(tmp_path):
    """The chief's Checkpointer asks for step None (the next step). When that request comes at the job's last
    step (ps-launch ... --epochs 10 --checkpoint-every-steps 10: 200 steps), nobody makes that step: after
    train() the chief leaves, and finish_job's Checkpointer.stop(final=True) must still return promptly
    with a final checkpoint, not after the periodic save's 300 s timeout. Same sequence as ps-worker's chief."""
    ckpt = tmp_path / "ckpt"
    with LocalCluster(1, workers=1, server_args=["--checkpoint-dir", str(ckpt)]) as local, \
            PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=3) as client:
        client.configure("sync", total_num_replicas=1)
        client.create_variables({"cp/v": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        client.join()
        checkpointer = Checkpointer(client, every_steps=10, keep=2).start()
        for _ in range(10):  # train(): on_step notes each global step
            checkpointer.note_step(client.push({"cp/v": torch.ones(2)}))
        wait_until(lambda: client.status(0).waiting_calls >= 1, 30, "the save of step 11 to wait on the shard")
        client.leave()  # train() is over
        stopper = threading.Thread(target=checkpointer.stop, kwargs={"final": True}, daemon=True)
        stopper.start()  # finish_job
        stopper.join(5)
        hung = stopper.is_alive()
        if hung:
            local.stop(grace=0.5)  # unblock the pending save so the thread ends
        assert not hung, "Checkpointer.stop(final=True) blocked on the save of a step the finished job never reaches"
        assert checkpointer.saved_steps and checkpointer.saved_steps[-1] == 10, checkpointer.saved_steps
        assert load_shard(ckpt, 10, 0)["step"] == 10, "the final checkpoint holds the last step"
        # the periodic save the idle job released holds step 10 too: it is numbered 10, never 11 (a checkpoint
        # numbered past its state would rank above the final one)
        assert checkpointer.saved_steps == [10, 10], checkpointer.saved_steps
        assert latest_committed(ckpt)[0] == 10


def test_a_commit_that_does_not_add_up_is_refused_and_commits_nothing(tmp_path):
    """CommitCheckpoint checks the manifest and every shard's file before writing anything."""
    ckpt = tmp_path / "ckpt"
    with LocalCluster(2, server_args=["--checkpoint-dir", str(ckpt)]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        client.create_variables({"c/a": torch.zeros(2), "c/b": torch.zeros(2)})
        good = json.dumps({"strategy": "round_robin", "num_ps": 2, "variables": [["c/a", 8], ["c/b", 8]]})
        saves = [client._fanout.channels.stubs[i].Save(ps_pb2.SaveRequest(step=5, now=True), timeout=20) for i in (0, 1)]
        cases = {
            "a manifest that is not one": (0, "not json", saves, InvalidArgumentError),
            "an unknown strategy": (0, good.replace("round_robin", "random"), saves, InvalidArgumentError),
            "a shard's file missing": (0, good, saves[:1], CheckpointError),
            "a size that differs": (0, good, [saves[0], ps_pb2.SaveResponse(index=1, bytes=3, step=0)],
                                    CheckpointError),
            "shard 1 asked to commit": (1, good, saves, ModeConflictError),
        }
        for what, (shard, manifest, shards, error) in cases.items():
            request = ps_pb2.CommitRequest(step=5, manifest_json=manifest, shards=shards, keep=3)
            with pytest.raises(error):
                client._fanout.channels.call(shard, lambda stub, t: stub.CommitCheckpoint(request, timeout=t), 20)
            assert not (step_dir(ckpt, 5) / "manifest.json").exists(), f"{what}: nothing may be committed"
        request = ps_pb2.CommitRequest(step=5, manifest_json=good, shards=saves, keep=3)
        client._fanout.channels.call(0, lambda stub, t: stub.CommitCheckpoint(request, timeout=t), 20)
        assert latest_committed(ckpt)[0] == 5
