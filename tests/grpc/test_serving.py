"""Serving replicas (ps-serve) on real processes: a replica follows two training shards' embedding rows and dense
variables, answers with one consistent version at a time, equals the shards bit for bit once it caught up,
rolls back to exactly a kept version's rows, says so in its metrics, comes back to the same rows after a
restart, reads a table larger than a message in pieces (one kept on SSD streamed from its store), and refuses what its callers may not do. Ordered by
events (the replica's own status), never by sleeping."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
import torch
from helpers import free_ports, wait_until

from torchps.certs import TaskCredentials
from torchps.client import Embedding, Optimizer, PSClient
from torchps.client.channels import ShardChannels
from torchps.cluster import Cluster, TaskSpec
from torchps.errors import InvalidArgumentError, PermissionDeniedError, ServingVersionError, UnknownVariableError
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.codec import MIN_CHUNK_BYTES
from torchps.security import Security
from torchps.serving import ServingClient

N, D = 64, 4
TIMEOUT = 30.0
IDS = torch.arange(N)


def _replica(local, tmp_path, *extra, name="serve"):
    """A ps-serve process following `local`'s shards; (process, address)."""
    (port,) = free_ports(1)
    log = open(tmp_path / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "torchps.serving.daemon", "--cluster",
                             json.dumps({"ps": local.cluster.ps}), "--bind", f"127.0.0.1:{port}", "--insecure",
                             "--poll-every", "0.05", "--dense-every", "0.2", *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    return proc, f"127.0.0.1:{port}"


def _stop(proc):
    proc.terminate()
    proc.wait(timeout=30)


def _caught_up(serving: ServingClient, step: int) -> ps_pb2.ServingStatus:
    """Waits until the replica's current version reflects training step `step` or later."""
    return wait_until(lambda: (s := _status(serving)) is not None and s.current.step >= step and s,
                      TIMEOUT, f"the replica to reach step {step}")


def _status(serving: ServingClient):
    try:
        return serving.status()
    except Exception:  # noqa: BLE001 - not serving yet
        return None


def _train(client: PSClient, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, N, (12,), generator=g)
        client.push({"dense/w": torch.randn(5, generator=g)}, rows={"t": (ids, torch.randn(12, D, generator=g))})


def test_a_replica_follows_training_and_equals_the_shards_bit_for_bit(local_cluster, tmp_path):
    local = local_cluster(2)
    (metrics_port,) = free_ports(1)
    proc, address = _replica(local, tmp_path, "--metrics-port", str(metrics_port))
    try:
        with PSClient(local.cluster, connect_timeout=10.0, timeout=TIMEOUT) as client, \
                ServingClient(address, timeout=TIMEOUT) as serving:
            client.create_tables([Embedding(N, D).table_spec("t", Optimizer("adagrad", lr=0.1))])
            client.create_variables({"dense/w": torch.zeros(5)}, Optimizer("sgd", lr=0.1))
            _train(client, 20)
            step = client.status(0).step
            _caught_up(serving, step)
            wait_until(lambda: torch.equal(serving.dense(["dense/w"]).tensors["dense/w"], client.pull(["dense/w"])
                                           ["dense/w"]), TIMEOUT, "the dense variable read again")
            served = serving.lookup("t", IDS)
            assert torch.equal(served.rows, client.lookup_rows({"t": IDS})["t"]) and bool(served.held.all())
            assert served.step >= step

            # Rollback: the rows of a kept version exactly, held there while training goes on; resume catches up.
            # Held while each batch of pushes is made, so every later version holds whole pushes: a round read while
            # a push is in flight may hold part of it under the step before (docs/guide/serving.md, "versions").
            kept = serving.status().current
            rows_then = serving.lookup("t", IDS)
            assert rows_then.version == kept.version
            for seed in (1, 3):
                serving.hold()
                _train(client, 5, seed=seed)
                serving.resume()
                _caught_up(serving, client.status(0).step)
            wait_until(lambda: not torch.equal(serving.lookup("t", IDS).rows, rows_then.rows), TIMEOUT,
                       "the replica to read the later pushes")
            assert len({v.version for v in serving.status().kept if v.version > kept.version}) >= 2
            back = serving.rollback(kept.step)
            assert back.held and back.current.version == kept.version and back.current.step == kept.step
            again = serving.lookup("t", IDS)
            assert torch.equal(again.rows, rows_then.rows) and again.version == kept.version
            _train(client, 3, seed=2)
            assert serving.status().current.version == again.version, "a held replica applied the stream"
            with pytest.raises(ServingVersionError, match="no kept version"):
                serving.rollback(0)
            serving.resume()
            final = client.status(0).step
            _caught_up(serving, final)
            trained = client.lookup_rows({"t": IDS})["t"]
            wait_until(lambda: torch.equal(serving.lookup("t", IDS).rows, trained), TIMEOUT,
                       "the replica to read the last pushes")

            # Its Prometheus metrics say the same as its status.
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=TIMEOUT).read().decode()
            values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                      if line.startswith("torchps_serving_")}
            status = serving.status()
            assert values["torchps_serving_step"] == status.current.step and values["torchps_serving_held"] == 0
            assert values["torchps_serving_rows"] == N and values["torchps_serving_lookup_seconds_count"] >= 4
            assert values["torchps_serving_rows_applied_total"] >= N and values["torchps_serving_resyncs_total"] >= 2

            # A replica killed and started again comes back to the same rows.
            _stop(proc)
            proc, address2 = _replica(local, tmp_path, name="serve-again")
            with ServingClient(address2, timeout=TIMEOUT) as again_serving:
                _caught_up(again_serving, final)
                assert torch.equal(again_serving.lookup("t", IDS).rows, client.lookup_rows({"t": IDS})["t"])
    finally:
        _stop(proc)


def test_a_replica_follows_live_resizes_and_never_serves_a_version_missing_a_row(local_cluster, tmp_path):
    """2 -> 3 -> 2 shards while the replica follows and a reader looks every row up: each resize re-lays the table
    out (rows move to and from ps 2) and may move the dense variable; the replica calls the shards of each new
    epoch (without, the rows ps 2 took are never read), every answer holds every row, and once caught up it
    equals the shards bit for bit."""
    local = local_cluster(2)
    proc, address = _replica(local, tmp_path)
    seen, stop = {"answers": 0, "missing": []}, threading.Event()
    try:
        with PSClient(local.cluster, connect_timeout=10.0, timeout=TIMEOUT) as client, \
                ServingClient(address, timeout=TIMEOUT) as serving:
            client.create_tables([Embedding(N, D).table_spec("t", Optimizer("adagrad", lr=0.1))])
            client.create_variables({"dense/w": torch.zeros(5)}, Optimizer("sgd", lr=0.1))
            _train(client, 5)
            _caught_up(serving, client.status(0).step)
            wait_until(lambda: serving.status().rows == N, TIMEOUT, "the whole read")

            def read() -> None:
                with ServingClient(address, timeout=TIMEOUT) as reader:
                    while not stop.is_set():
                        answer = reader.lookup("t", IDS)
                        seen["answers"] += 1
                        if not bool(answer.held.all()):
                            seen["missing"].append(answer.version)

            reader = threading.Thread(target=read)
            reader.start()

            def equal() -> bool:
                return torch.equal(serving.lookup("t", IDS).rows, client.lookup_rows({"t": IDS})["t"]) and \
                    torch.equal(serving.dense(["dense/w"]).tensors["dense/w"], client.pull(["dense/w"])["dense/w"])

            for target, seed in (([*local.cluster.ps, local.add_ps()], 1), (list(local.cluster.ps), 2)):
                answered = seen["answers"]
                report = client.resize(target, drain_seconds=1.0)
                assert report.shards_after == len(target)
                _train(client, 5, seed=seed)
                _caught_up(serving, client.status(0).step)
                wait_until(equal, TIMEOUT, f"the replica to equal the {len(target)} shards")
                wait_until(lambda: seen["answers"] > answered + 2, TIMEOUT, "lookups through the resize")
            stop.set()
            reader.join(TIMEOUT)
            assert seen["missing"] == [], f"versions that lacked rows: {seen['missing']}"
            assert proc.poll() is None
    finally:
        stop.set()
        _stop(proc)


def test_a_replica_refuses_bad_requests_and_what_a_callers_role_may_not_do(local_cluster, tmp_path):
    """Per-task tokens: the replica reads the shards in the serving role (which may not push), a worker may look
    rows up but not roll the replica back, a call without a token is refused; bad requests get their status
    code and change nothing."""
    tokens = tmp_path / "tokens"
    tokens.write_text("chief:0 chief chief-token\nserving:0 serving serve-token\nworker:0 worker worker-token\n")
    security = {}
    for task, token in (("chief", "chief-token"), ("worker", "worker-token"), ("serving", "serve-token")):
        (tmp_path / f"{task}.token").write_text(token + "\n")
        security[task] = Security.load(token_file=str(tmp_path / f"{task}.token"))
    local = local_cluster(1, server_args=["--token-file", str(tokens)])
    (port,) = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-m", "torchps.serving.daemon", "--cluster",
                             json.dumps({"ps": local.cluster.ps}), "--bind", f"127.0.0.1:{port}",
                             "--token-file", str(tokens), "--poll-every", "0.05"],
                            stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        with PSClient(local.cluster, security=security["chief"], connect_timeout=10.0, timeout=TIMEOUT) as chief, \
                ServingClient(address, security=security["worker"], timeout=TIMEOUT) as as_worker, \
                ServingClient(address, security=security["chief"], timeout=TIMEOUT) as as_chief:
            chief.create_tables([Embedding(N, D).table_spec("t", Optimizer("sgd", lr=1.0))])
            _caught_up(as_worker, 0)
            wait_until(lambda: as_worker.status().rows == N, TIMEOUT, "the replica to read the table")
            before = as_worker.lookup("t", IDS)
            assert torch.equal(before.rows, chief.lookup_rows({"t": IDS})["t"])

            with pytest.raises(PermissionDeniedError, match="the worker role may call only"):
                as_worker.rollback(0)
            with pytest.raises(InvalidArgumentError, match="HOLD, RESUME or ROLLBACK"):
                as_chief.control(0)
            with pytest.raises(InvalidArgumentError, match="1-D int64"):
                as_worker.lookup("t", IDS.float())
            with pytest.raises(UnknownVariableError, match="no table 'nope'"):
                as_worker.lookup("nope", IDS)
            stub = ps_pb2_grpc.ServingStub(grpc.insecure_channel(address))
            with pytest.raises(grpc.RpcError) as raw:
                stub.Lookup(ps_pb2.ServingLookupRequest(table="t", ids=b"\x00" * 7),
                            metadata=(("torchps-token", "worker-token"),), timeout=TIMEOUT)
            assert raw.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "multiple of 8" in raw.value.details()
            with pytest.raises(grpc.RpcError) as raw:
                stub.GetServingStatus(ps_pb2.ServingStatusRequest(), timeout=TIMEOUT)
            assert raw.value.code() is grpc.StatusCode.UNAUTHENTICATED and "carries no token" in raw.value.details()
            with ServingClient(address, security=security["chief"], timeout=TIMEOUT) as admin:
                assert admin.hold().held and not admin.resume().held

            # The serving role reads the shards and may not change them.
            shard = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(local.cluster.ps[0]))
            with pytest.raises(grpc.RpcError) as raw:
                shard.Configure(ps_pb2.SyncConfig(), metadata=(("torchps-token", "serve-token"),), timeout=TIMEOUT)
            assert raw.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert torch.equal(as_worker.lookup("t", IDS).rows, before.rows), "a refused call changed the replica"
            assert proc.poll() is None
    finally:
        _stop(proc)


def test_a_replica_whose_line_the_token_table_lacks_says_so_and_exits_2(tmp_path):
    """ps-serve with a token table that has no line for its --task would call the shards with no token of its
    own: it refuses to start (exit 2), naming the line and how to add it."""
    tokens = tmp_path / "tokens"
    tokens.write_text("chief:0 chief chief-token\nworker:0 worker worker-token\n")
    (port,) = free_ports(1)
    done = subprocess.run([sys.executable, "-m", "torchps.serving.daemon", "--cluster",
                           json.dumps({"ps": ["127.0.0.1:1"]}), "--bind", f"127.0.0.1:{port}", "--token-file",
                           str(tokens)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "has no line for serving:0" in done.stderr and "ps-certs DIR --add serving:0=HOST:PORT" in done.stderr


def test_a_replica_with_the_credentials_ps_certs_adds_serves_a_tls_job_and_may_only_read(local_cluster, tmp_path):
    """`ps-certs DIR --cluster ...`, then `ps-certs DIR --add serving:0=HOST:PORT` (docs/guide/serving.md): the
    replica's certificate (role serving) and the shards' token table; it serves mutual TLS, reads the shard,
    answers a worker and, to the chief's admin token, holds; its credentials may read a shard, not change it."""
    p0, chief_port, worker_port, port = free_ports(4)
    spec = {"chief": [f"127.0.0.1:{chief_port}"], "worker": [f"127.0.0.1:{worker_port}"], "ps": [f"127.0.0.1:{p0}"]}
    folder = tmp_path / "job"
    made = subprocess.run([sys.executable, "-m", "torchps.certs", str(folder), "--cluster", json.dumps(spec)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    added = subprocess.run([sys.executable, "-m", "torchps.certs", str(folder), "--add", f"serving:0=127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=60)
    assert added.returncode == 0, added.stderr
    assert added.stdout.startswith("serving:0: --tls-cert ") and "TF_CONFIG" not in added.stdout, added.stdout
    flags = added.stdout.split(": ", 1)[1].split()
    assert flags[-2:] == ["--task", "serving:0"] and f"{folder / 'tokens'}" in flags, flags
    assert "serving:0 serving " in (folder / "tokens").read_text() and not (folder / "serving-0.token").exists()
    cluster = Cluster.from_dict(spec)
    local = local_cluster(1, ports=[p0], server_args=TaskCredentials.of(folder, cluster, TaskSpec("ps", 0)).flags())
    proc = subprocess.Popen([sys.executable, "-m", "torchps.serving.daemon", "--cluster", json.dumps(spec),
                             "--bind", f"127.0.0.1:{port}", "--poll-every", "0.05", *flags],
                            stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    chief, worker = (TaskCredentials.of(folder, cluster, TaskSpec(kind, 0)).security() for kind in ("chief", "worker"))
    serving = TaskCredentials.at(folder, TaskSpec("serving", 0), "serving").security().as_task("serving:0")
    try:
        with PSClient(local.cluster, task=TaskSpec("chief", 0), security=chief, connect_timeout=10.0,
                      timeout=TIMEOUT) as trainer, \
                ServingClient(address, security=worker, timeout=TIMEOUT) as as_worker:
            trainer.create_tables([Embedding(N, D).table_spec("t", Optimizer("sgd", lr=1.0))])
            wait_until(lambda: (s := _status(as_worker)) is not None and s.rows == N, TIMEOUT, "the whole read")
            assert torch.equal(as_worker.lookup("t", IDS).rows, trainer.lookup_rows({"t": IDS})["t"])
            with pytest.raises(PermissionDeniedError):
                as_worker.hold()
            with ServingClient(address, security=chief, timeout=TIMEOUT) as admin:
                assert admin.hold().held and not admin.resume().held
            with pytest.raises(grpc.RpcError) as refused:  # a caller without the job's certificate: no TLS session
                ps_pb2_grpc.ServingStub(grpc.insecure_channel(address)).GetServingStatus(
                    ps_pb2.ServingStatusRequest(), timeout=5)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            shard = ShardChannels([local.cluster.ps[0]], connect_timeout=10, security=serving)
            try:
                assert shard.call(0, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t), TIMEOUT)
                with pytest.raises(PermissionDeniedError, match="serving role"):
                    shard.call(0, lambda stub, t: stub.Configure(ps_pb2.SyncConfig(), timeout=t), TIMEOUT)
            finally:
                shard.close()
            assert proc.poll() is None
    finally:
        _stop(proc)


def test_a_table_larger_than_a_message_is_read_in_pieces_under_the_shards_size_limit(local_cluster, tmp_path):
    """A shard whose messages are cut at the smallest --max-chunk-bytes sends a table's changes in several
    messages, each under its gRPC limit (ids and held bytes counted with the rows), first and last marked; the
    replica reads the whole table through them and equals the shard."""
    rows = 20_000
    local = local_cluster(1, server_args=["--max-chunk-bytes", str(MIN_CHUNK_BYTES)])
    proc, address = _replica(local, tmp_path)
    try:
        with PSClient(local.cluster, connect_timeout=10.0, timeout=TIMEOUT) as client, \
                ServingClient(address, timeout=TIMEOUT) as serving:
            client.create_tables([Embedding(rows, D).table_spec("big", Optimizer("sgd", lr=1.0))])
            stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(local.cluster.ps[0]))
            sized = list(stub.ReadChanges(ps_pb2.ChangesRequest(), timeout=TIMEOUT))
            assert len(sized) > 1 and all(m.ByteSize() <= MIN_CHUNK_BYTES + 1024 for m in sized)  # the chunk: ids too
            pieces = list(stub.ReadChanges(ps_pb2.ChangesRequest(max_rows=1500), timeout=TIMEOUT))
            assert [len(m.ids) // 8 for m in pieces] == [1500] * 13 + [rows - 13 * 1500]
            assert [(m.first, m.last) for m in pieces] == [(True, False)] + [(False, False)] * 12 + [(False, True)]
            assert all(m.whole for m in pieces)
            wait_until(lambda: (s := _status(serving)) is not None and s.rows == rows, TIMEOUT, "the whole read")
            for part in torch.arange(rows).split(2000):  # a shard's requests, too, are cut at its small limit
                assert torch.equal(serving.lookup("big", part).rows, client.lookup_rows({"big": part})["big"])
    finally:
        _stop(proc)


def test_a_replica_reads_a_table_kept_on_ssd_whole_in_parts_then_follows_it(local_cluster, tmp_path):
    """Two shards keep a dynamic table on SSD, their caches a fraction of it, their messages at the smallest
    size: the replica's first read streams each shard's store in several parts (whole, first and last marked)
    and equals the shards; it then follows the rows training changes."""
    local = local_cluster(2, server_args=["--table-storage", "ssd", "--table-dir", str(tmp_path / "tables"),
                                          "--table-cache", "64K", "--max-chunk-bytes", str(MIN_CHUNK_BYTES)])
    ids = torch.arange(-6000, 6000)
    with PSClient(local.cluster, connect_timeout=10.0, timeout=TIMEOUT) as client:
        client.create_tables([Embedding(None, D).table_spec("dyn", Optimizer("adagrad", lr=0.1))])
        for part in ids.split(3000):
            client.lookup_rows({"dyn": part}, admit=True)
        client.push({}, rows={"dyn": (ids[::7], torch.ones(len(ids[::7]), D))})
        statuses = [t for i in range(2) for t in client.status(i).tables]
        assert all(t.storage == "ssd" and t.rows > 4 * t.cache_rows for t in statuses), statuses
        stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(local.cluster.ps[1]))
        pieces = list(stub.ReadChanges(ps_pb2.ChangesRequest(tables=["dyn"]), timeout=TIMEOUT))
        assert len(pieces) > 2 and all(m.whole and m.ByteSize() <= MIN_CHUNK_BYTES + 1024 for m in pieces)
        assert [(m.first, m.last) for m in pieces] == [(True, False)] + [(False, False)] * (len(pieces) - 2) + \
            [(False, True)]
        assert sum(len(m.ids) // 8 for m in pieces) == len(ids) // 2
        proc, address = _replica(local, tmp_path)
        try:
            with ServingClient(address, timeout=TIMEOUT) as serving:
                wait_until(lambda: (s := _status(serving)) is not None and s.rows == len(ids), TIMEOUT,
                           "the whole read")
                assert torch.equal(serving.lookup("dyn", ids).rows, client.lookup_rows({"dyn": ids})["dyn"])
                changed = ids[::5]
                client.push({}, rows={"dyn": (changed, torch.ones(len(changed), D))})
                trained = client.lookup_rows({"dyn": ids})["dyn"]
                # (a version's step says it holds no later change, not that it holds that step's: wait for the rows)
                wait_until(lambda: torch.equal(serving.lookup("dyn", ids).rows, trained), TIMEOUT,
                           "the replica to read the rows the push changed")
        finally:
            _stop(proc)


def test_a_replica_starts_from_a_checkpoint_then_reads_only_what_changed_since_and_filters_by_updates(
        local_cluster, tmp_path):
    """A replica given the job's --checkpoint-dir serves the checkpoint as its first version and then asks the
    shards only for the rows changed since it (none read whole); one given --min-updates 2 too serves only rows
    pushes updated twice, from the checkpoint's update counts and from the stream alike."""
    folder = tmp_path / "ckpt"
    local = local_cluster(2, server_args=["--checkpoint-dir", str(folder)])
    g = torch.Generator().manual_seed(3)
    replicas = []
    try:
        with PSClient(local.cluster, connect_timeout=10.0, timeout=TIMEOUT) as client:
            client.create_tables([Embedding(N, D).table_spec("t", Optimizer("adagrad", lr=0.1))])
            client.create_variables({"dense/w": torch.zeros(5)}, Optimizer("sgd", lr=0.1))
            for ids in (IDS, IDS[:N // 2]):  # rows 0-31 updated twice, 32-63 once
                client.push({"dense/w": torch.randn(5, generator=g)},
                            rows={"t": (ids, torch.randn(len(ids), D, generator=g))})
            saved = client.save_checkpoint(0)
            at_checkpoint = client.lookup_rows({"t": IDS})["t"]
            changed = torch.tensor([3, 40])  # 3: a third update, 40: its second
            client.push({"dense/w": torch.randn(5, generator=g)}, rows={"t": (changed, torch.randn(2, D, generator=g))})
            final = client.status(0).step
            replicas = [_replica(local, tmp_path, "--checkpoint-dir", str(folder), name="from-checkpoint"),
                        _replica(local, tmp_path, "--checkpoint-dir", str(folder), "--min-updates", "2",
                                 name="filtered")]
            (_, address), (_, filtered_at) = replicas
            shards = client.lookup_rows({"t": IDS})["t"]
            with ServingClient(address, timeout=TIMEOUT) as serving, \
                    ServingClient(filtered_at, timeout=TIMEOUT) as filtered:
                status = _caught_up(serving, final)
                assert status.kept[0].step == saved, "its first version is the checkpoint's"
                assert status.resyncs == 0 and status.rows_applied == N + len(changed), \
                    "the shards sent the two rows changed since the checkpoint, no table whole"
                assert torch.equal(serving.lookup("t", IDS).rows, shards)
                wait_until(lambda: torch.equal(serving.dense(["dense/w"]).tensors["dense/w"],
                                               client.pull(["dense/w"])["dense/w"]), TIMEOUT, "the dense variable")
                assert serving.rollback(saved).current.step == saved
                assert torch.equal(serving.lookup("t", IDS).rows, at_checkpoint)

                _caught_up(filtered, final)
                served = filtered.lookup("t", IDS)
                twice = (IDS < N // 2) | (IDS == 40)
                assert served.held.tolist() == twice.tolist()
                assert torch.equal(served.rows[twice], shards[twice])
                assert filtered.status().resyncs == 0
    finally:
        for proc, _ in replicas:
            _stop(proc)


def test_a_loss_guard_keeps_a_worse_version_from_being_served_until_training_mends_it(local_cluster, tmp_path):
    """ps-serve --guard: the user's loss (here the dense weight itself) is computed on each version before it
    is published; a version whose loss rose by more than --guard-max-increase is refused (counted, said in the
    status) and the served one stays; once training brings the loss back, the next version is published."""
    guard = tmp_path / "guard.py"
    guard.write_text("def loss(model):\n    return float(model.dense(['dense/w'])['dense/w'][0])\n")
    local = local_cluster(1)
    proc = None
    try:
        with PSClient(local.cluster, connect_timeout=10.0, timeout=TIMEOUT) as client:
            client.create_variables({"dense/w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
            proc, address = _replica(local, tmp_path, "--guard", f"{guard}:loss", "--guard-max-increase", "0.5")
            with ServingClient(address, timeout=TIMEOUT) as serving:
                _caught_up(serving, 0)
                wait_until(lambda: "dense/w" in serving.dense().tensors, TIMEOUT, "the first version")
                client.push({"dense/w": torch.tensor([-0.25, 0.0])})  # loss 0 -> 0.25: within the bound
                wait_until(lambda: serving.dense(["dense/w"]).tensors["dense/w"][0] == 0.25, TIMEOUT, "0.25 served")
                client.push({"dense/w": torch.tensor([-1.0, -1.0])})  # 0.25 -> 1.25: refused
                # The guard counts a refusal, then the follower says it (two objects): waited for, both
                status = wait_until(lambda: (s := serving.status()).guard_refused >= 1 and "guard refused" in s.error
                                    and s, TIMEOUT, "a refusal, counted and said")
                assert status.guard_loss == 1.25 and status.guard_baseline == 0.25
                assert serving.dense(["dense/w"]).tensors["dense/w"].tolist() == [0.25, 0.0], "the served version"
                said = subprocess.run([sys.executable, "-m", "torchps.serving.daemon", "status", "--at", address,
                                       "--insecure"], capture_output=True, text=True, timeout=TIMEOUT).stdout
                assert re.search(r"guard: \d+ refused, last loss 1.25, served 0.25", said), said
                client.push({"dense/w": torch.tensor([0.75, 0.0])})  # 1.25 -> 0.5: passes again
                wait_until(lambda: serving.dense(["dense/w"]).tensors["dense/w"].tolist() == [0.5, 1.0], TIMEOUT,
                           "the mended version served")
                assert serving.status().error == ""
    finally:
        if proc is not None:
            _stop(proc)


def test_a_replica_stops_at_once_on_sigterm_while_its_read_waits_for_a_shard(tmp_path):
    """A shard that accepts the replica's connection and never answers (a host gone quiet): the replica's read
    waits on it; SIGTERM ends the read and the replica within seconds, not when the read's retries run out, nor
    after a look at what answers there (3 s), and its reading thread ends without a traceback."""
    with socket.create_server(("127.0.0.1", 0)) as quiet:
        (port,) = free_ports(1)
        log = open(tmp_path / "serve.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "torchps.serving.daemon", "--cluster",
                                 json.dumps({"ps": [f"127.0.0.1:{quiet.getsockname()[1]}"]}), "--bind",
                                 f"127.0.0.1:{port}", "--insecure"], stdout=log, stderr=subprocess.STDOUT)
        try:
            quiet.settimeout(TIMEOUT)
            connection, _ = quiet.accept()  # the replica's first read is under way
            with connection:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=5) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    said = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in said, said
