"""The hybrid (dense all-reduce + tables on the shards) end to end: real shards, real worker processes.

- Two worker processes (torchps.client API) train a model with an EmbeddingBag on two shards under dense
  layers: after several steps both hold the same dense parameters, equal to one plain torch process on the
  combined batch with the same optimizer to 1e-5, with one all_reduce per step.
  What makes it exact: the table's row optimizer is SGD with lr 0, so its rows never change and every
  worker's forward reads the same rows whatever order the shards apply the other's pushes in (async);
  the row gradients are still pushed (counted by every shard). The loss is a mean over each worker's b
  rows, so the average of the two workers' gradients is the combined batch's mean gradient; the
  difference left is float rounding (sum then halve versus one sum over 2b rows).
  The model also has a layer only worker 0's rows reach (worker 1 has no gradient for it: its share counts
  as zeros) and a parameter no forward reaches (its gradient stays None, as in the reference).
- `ps-launch --dense allreduce` (ps-worker's flag, passed through): two workers train a synthetic embedding
  model (no dataset needed), the job exits 0, the chief's summary counts synchronous steps, and --export
  writes the dense state_dict.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import torch
from torch import nn

from helpers import forkserver_context, free_port
from torchps.client import Cluster, PSClient
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import hybrid_workers  # noqa: E402 - needs the path above under any import mode
from test_launch import PS_LAUNCH, environ  # noqa: E402

CTX = forkserver_context()  # fresh processes, never forked from this gRPC-threaded one
TIMEOUT = 90.0
STEPS, BATCH = 5, 4
HERE = pathlib.Path(__file__).resolve().parent


def hybrid_cluster(local: LocalCluster, workers: int = 2) -> dict:
    """The shards' cluster with `workers` worker entries on free loopback ports (worker 0's is the group's
    rendezvous port)."""
    return {"ps": list(local.cluster.ps), "worker": [f"127.0.0.1:{free_port()}" for _ in range(workers)]}


def test_dense_parameters_equal_one_process_on_the_combined_batch(local_cluster, tmp_path):
    cluster = hybrid_cluster(local_cluster(2))
    outs = [tmp_path / f"worker{i}.pt" for i in range(2)]
    procs = [CTX.Process(target=hybrid_workers.hybrid_worker, args=(cluster, i, 2, BATCH, STEPS, str(outs[i])),
                         daemon=True) for i in range(2)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + TIMEOUT
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for proc in hung:
        proc.kill()
    assert not hung and [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]
    with PSClient(Cluster.from_dict(cluster), connect_timeout=10.0) as ps:
        names = [f"{opt}/bag.weight" for opt in hybrid_workers.OPTIMIZERS]
        ps.wait_for_tables(names, timeout=10.0)
        rows = {name: ps.lookup_rows({name: torch.arange(hybrid_workers.ROWS)})[name] for name in names}
        counts = {name: [next(t for t in ps.status(s).tables if t.name == name).optimizer_steps
                         for s in range(2)] for name in names}
    saved = [torch.load(out, weights_only=True) for out in outs]
    # One all_reduce per step per model (its dense parameters are one bucket), one broadcast per model.
    assert saved[0]["calls"] == saved[1]["calls"] == len(hybrid_workers.OPTIMIZERS) * (1 + STEPS)
    ids, y = hybrid_workers.make_data(STEPS, 2 * BATCH)
    for opt, (_, torch_optimizer) in hybrid_workers.OPTIMIZERS.items():
        # Every shard counted every worker's push of the table's rows, each step.
        assert counts[f"{opt}/bag.weight"] == [2 * STEPS, 2 * STEPS]
        first, second = saved[0][opt], saved[1][opt]
        assert first["step"] == second["step"] == STEPS
        # The workers started apart (seeds 100 and 101); the broadcast gave both the chief's values.
        for key in first["start"]:
            assert torch.equal(first["start"][key], second["start"][key]), key
        apart = hybrid_workers.Model(seed=100).hidden.weight, hybrid_workers.Model(seed=101).hidden.weight
        assert not torch.equal(*apart)
        # Both workers stepped the same averaged gradients: the same bits.
        for key in first["end"]:
            assert torch.equal(first["end"][key], second["end"][key]), key
        bag = nn.EmbeddingBag.from_pretrained(rows[f"{opt}/bag.weight"], freeze=True, mode="mean")
        reference = hybrid_workers.Model(seed=0, bag=bag)
        reference.load_state_dict(first["start"], strict=False)  # all but the table, which `bag` holds
        optimizer = torch_optimizer([p for p in reference.parameters() if p.requires_grad])
        for k in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(reference(ids[k]), y[k]).backward()
            optimizer.step()
        ours, theirs = first["end"], reference.state_dict()
        assert sorted(ours) == sorted(k for k in theirs if not k.startswith("bag."))
        for key, value in ours.items():
            torch.testing.assert_close(value, theirs[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{opt} {key}: {m}")
        # Trained: every parameter some worker had a gradient for moved (`rare` only through worker 0's rows);
        # `unused`, which no forward touched, kept its value (its gradient stayed None, so no momentum or
        # Adam step touched it), as in the reference.
        for key, value in ours.items():
            assert torch.equal(value, first["start"][key]) == (key in ("unused", "scale")), f"{opt} {key}"


def test_ps_launch_dense_allreduce_trains_and_exports(tmp_path):
    """ps-launch passes --dense allreduce to every worker and gives the chief's entry a free port for the
    group; the job ends by itself with exit code 0 (shards secured with TLS as usual)."""
    export, metrics = tmp_path / "dense.pt", tmp_path / "summary.json"
    run = subprocess.run([*PS_LAUNCH, "--ps", "1", "--workers", "2", "--dense", "allreduce", "--entry",
                          "hybrid_entry:task", "--steps", "6", "--batch-size", "16", "--lr", "0.1",
                          "--allreduce-timeout", "30", "--export", str(export), "--metrics-out", str(metrics)],
                         capture_output=True, text=True, env=environ([HERE]), timeout=TIMEOUT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(metrics.read_text())
    assert summary["dense"] == "allreduce" and summary["mode"] == "async"
    assert summary["global_step"] == 6 and summary["local_steps"] == 6  # synchronous steps, every worker the same
    assert summary["table_pushes"] == 12  # the shards' step: each worker pushed its rows every step
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    assert "[worker:1] " in run.stdout and "all-reduce group formed: rank 1 of 2" in run.stdout
    assert "[launch] done, exit code 0" in run.stdout
    state = torch.load(export, weights_only=True)
    assert sorted(state) == ["bag.weight", "head.bias", "head.weight"]  # dense parameters, the table whole
    twin = nn.ModuleDict({"bag": nn.EmbeddingBag(50, 8, mode="mean"), "head": nn.Linear(8, 2)})
    twin.load_state_dict(state)  # torch's own modules take it
