"""Every RPC of the ParameterServer service against every kind of intruder, on one secure shard.

The methods come from ps.proto's descriptor, so an RPC added later is covered without touching this
file. One shard (mutual TLS, job token and admin token, --checkpoint-dir in a tmp folder) serves the
whole module: its chief configured it, created `w`, the data queue `q` and the embedding table `t`,
worker:1 joined and pushed once, and the chief committed a checkpoint. Then, per RPC, raw gRPC calls (no PSClient: nothing
retries or rewrites them) carry a request that would change the shard if it were served (but the reads,
see READS), with:

    no-token         the chief's certificate, no token metadata              UNAUTHENTICATED
    wrong-token      the chief's certificate, a wrong token                  UNAUTHENTICATED
    worker-admin     worker:0's valid credentials on an admin RPC            PERMISSION_DENIED
    evaluator        evaluator:0's valid credentials on an RPC it may not    PERMISSION_DENIED
                     call (not in ROLES["evaluator"])
    other-ca         a certificate of another CA, with the admin token       UNAVAILABLE: no connection (the
                     (the client trusts the job's CA: only the shard refuses) shard refuses the handshake)
    plaintext        no TLS at all, with the admin token                     UNAVAILABLE: no connection

and after each, the shard's state is what it was when the module started: values, versions, specs,
step, membership, mode, counters of pushed bytes and waiting calls, the process and its generation,
and every file under the checkpoint dir (journal included) by name, size, mtime and inode.
`test_the_chiefs_own_requests_do_change_the_shard` shows, on a second shard, that the same requests
sent with the chief's credentials do change that state, so the matrix cannot pass vacuously.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import struct

import grpc
import pytest
import torch
from google.protobuf import json_format, message_factory

from torchps.certs import make_job_credentials
from torchps.client import DataQueue, Optimizer, PSClient, TaskSpec, UnknownDataQueueError
from torchps.cluster import Cluster
from torchps.proto import ps_pb2
from torchps.security import ADMIN_METHODS, REPLICA_METHODS, ROLES, TOKEN_METADATA_KEY, Security
from torchps.worker.local_cluster import LocalCluster

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
METHODS = {method.name: method for method in SERVICE.methods}
DEADLINE = 10.0  # seconds, every raw call
PLACEHOLDER = Cluster(ps=("127.0.0.1:1",), chief=("127.0.0.1:2",), worker=("127.0.0.1:3", "127.0.0.1:4"),
                      evaluator=("127.0.0.1:5",))
CHIEF, WORKER0, WORKER1, EVALUATOR, PS = (TaskSpec("chief", 0), TaskSpec("worker", 0), TaskSpec("worker", 1),
                                          TaskSpec("evaluator", 0), TaskSpec("ps", 0))
INCARNATION = 41     # worker:1's, as it joined
SAVE_STEP = 7        # a checkpoint folder nobody made
LONG = 3600.0        # lease, startup grace and progress timeout: no membership event during the module
STATUS_FIELDS = ("index", "step", "num_variables", "total_bytes", "pid", "live_workers", "quorum", "stale_dropped",
                 "quorum_changes", "workers_expired", "generation", "restored_step", "checkpoints",
                 "push_bytes_received", "workers_stalled", "duplicates", "waiting_calls", "layout_epoch")
# RPCs whose request below cannot change the shard when served (they read). Every other request does,
# but Configure: with worker:1 joined, the shard refuses another mode (FAILED_PRECONDITION) even to the
# chief, so its denial shows in its status code alone.
READS = frozenset({"Pull", "PullOne", "ListVariables", "GetStatus", "LookupRows", "ListTables", "GetDataQueue",
                   "GetLayout", "ReadChanges"})
# The chief's moves of a live resize, refused on this shard whatever the caller (the chief's SetLayout, served
# before them, sets epoch 1 with "w" on ps 0: the export asks ps 0 to send "w" to itself, the import carries no
# state): the chief's get past the credentials to this refusal, and change nothing either.
# A shard's replication calls, as a chief sends them here: a backup of another shard, a change of ps 0's record
# naming no primary; the chief's get past the credentials to these refusals.
REFUSED_FOR_THE_CHIEF = {"ExportVariables": "cannot export to itself", "ImportVariables": "could not be read",
                         "ConfirmMove": "a move to itself", "Replicate": "this is ps:0",
                         "SetReplica": "names its primary's address"}


def _ones(n: int) -> bytes:
    return struct.pack(f"<{n}f", *([1.0] * n))


META = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[2])
GRADIENT = ps_pb2.TensorChunk(name="w", meta=META, offset=0, data=_ones(2))


def table_spec(name: str) -> ps_pb2.TableSpec:
    return ps_pb2.TableSpec(name=name, dim=2, num_embeddings=4, dtype=ps_pb2.FLOAT32,
                            optimizer=ps_pb2.OptimizerSpec(name="sgd"),
                            init=ps_pb2.TableInit(distribution="normal", scale=1.0))


def requests_for(shard: "Shard") -> dict[str, list]:
    """Per RPC, the request messages a served call would act on (one, or a stream's)."""
    push = ps_pb2.PushHeader(worker="worker:1", step=1, step_increment=1, tensors=1)
    push_pull = ps_pb2.PushHeader(worker="worker:1", step=1, step_increment=1, tensors=1, pull=["w"])
    return {
        "CreateVariables": [ps_pb2.CreateRequest(
            count=1, spec=ps_pb2.VariableSpec(name="intruder", meta=META, optimizer=ps_pb2.OptimizerSpec(name="sgd")),
            chunk=ps_pb2.TensorChunk(name="intruder", offset=0, data=_ones(2)))],
        "Pull": [ps_pb2.PullRequest(names=["w"])],
        "PullOne": [ps_pb2.PullRequest(names=["w"])],
        "Push": [ps_pb2.PushRequest(header=push, chunks=[GRADIENT])],
        "PushOne": [ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="worker:1", step=1, step_increment=1,
                                                                 tensors=1, seq=2), chunks=[GRADIENT])],
        "PushPull": [ps_pb2.PushRequest(header=push_pull, chunks=[GRADIENT])],
        "UpdateOptimizer": [ps_pb2.UpdateOptimizerRequest(hyperparams={"lr": 5.0})],
        "ListVariables": [ps_pb2.ListRequest()],
        "GetStatus": [ps_pb2.StatusRequest()],
        "Configure": [ps_pb2.SyncConfig(mode="sync", total_num_replicas=1)],
        "Join": [ps_pb2.WorkerRef(worker="worker:0", incarnation=5, step=1)],
        "Heartbeat": [ps_pb2.WorkerRef(worker="worker:2", incarnation=6, step=1)],
        "Leave": [ps_pb2.WorkerRef(worker="worker:1", incarnation=INCARNATION)],
        "Save": [ps_pb2.SaveRequest(step=SAVE_STEP, now=True)],
        "CommitCheckpoint": [shard.commit_again],
        "Shutdown": [ps_pb2.ShutdownRequest(reason="an intruder")],
        "CreateTables": [ps_pb2.CreateTablesRequest(tables=[table_spec("intruder-table")], num_shards=1)],
        # A fixed-size table: even an admitting lookup changes no row.
        "LookupRows": [ps_pb2.LookupRowsRequest(tables=[ps_pb2.TableIds(name="t", ids=struct.pack("<2q", 0, 3))],
                                                admit=True)],
        "ListTables": [ps_pb2.ListRequest()],
        "CreateDataQueue": [ps_pb2.DataQueueSpec(name="intruder-queue", num_examples=4, shard_size=2)],
        # worker:1 (joined) would be handed a shard of the chief's queue.
        "TakeDataShard": [ps_pb2.TakeDataShardRequest(queue="q", worker="worker:1", incarnation=INCARNATION)],
        "GetDataQueue": [ps_pb2.DataQueueRequest(name="q")],
        "GetLayout": [ps_pb2.LayoutRequest()],
        "SetLayout": [ps_pb2.Layout(epoch=1, addresses=[shard.local.address(0)], placement={"w": 0})],
        "ExportVariables": [ps_pb2.MoveRequest(names=["w"], epoch=1, to=0)],
        "ImportVariables": [ps_pb2.MoveChunk(epoch=1)],
        "ConfirmMove": [ps_pb2.MoveRequest(names=["w"], to=0)],
        "Resize": [ps_pb2.ResizeRequest(action=ps_pb2.ResizeRequest.BEGIN, driver="intruder",
                                        before=[shard.local.address(0)],
                                        after=[shard.local.address(0), "127.0.0.1:9"])],
        "Replicate": [ps_pb2.ReplicaAck(hello=ps_pb2.ReplicaHello(index=5, address="127.0.0.1:9"))],
        "SetReplica": [ps_pb2.ReplicaChange(action=ps_pb2.ReplicaChange.DROP, index=0)],
    }


def request(shard: "Shard", method) -> list:
    """The request(s) for `method`; an empty message for an RPC this file does not know yet."""
    known = requests_for(shard).get(method.name)
    return known if known is not None else [message_factory.GetMessageClass(method.input_type)()]


# -- raw calls -------------------------------------------------------------------------------------


def channel(address: str, cert: pathlib.Path | None, key: pathlib.Path | None, ca: pathlib.Path | None):
    """A channel of its own (no subchannel shared with another test's), TLS if `ca` is given."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    if ca is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes(), private_key=key.read_bytes(),
                                               certificate_chain=cert.read_bytes())
    return grpc.secure_channel(address, credentials, options=options)


def call(chan: grpc.Channel, method, requests: list, token: str | None) -> tuple[grpc.StatusCode, str, list]:
    """(status, details, replies) of one call of `method` with a deadline; never raises for a status."""
    kind = {(False, False): chan.unary_unary, (False, True): chan.unary_stream,
            (True, False): chan.stream_unary, (True, True): chan.stream_stream}
    stub = kind[(method.client_streaming, method.server_streaming)](
        f"/{SERVICE.full_name}/{method.name}",
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=message_factory.GetMessageClass(method.output_type).FromString)
    metadata = ((TOKEN_METADATA_KEY, token),) if token is not None else None
    argument = iter(requests) if method.client_streaming else requests[0]
    try:
        reply = stub(argument, timeout=DEADLINE, metadata=metadata)
        replies = list(reply) if method.server_streaming else [reply]
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", []
    return grpc.StatusCode.OK, "", replies


# -- the shard -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Shard:
    local: LocalCluster
    files: dict            # TaskSpec -> TaskCredentials, the job's
    foreign: dict          # the same, made by another CA
    chief: PSClient
    checkpoint_dir: pathlib.Path
    commit_again: ps_pb2.CommitRequest  # the chief's commit of its checkpoint, as it sent it
    tokens: dict[str, str]

    @property
    def address(self) -> str:
        return self.local.cluster.ps[0]

    def as_task(self, task: TaskSpec, files: dict | None = None) -> grpc.Channel:
        f = (files or self.files)[task]
        return channel(self.address, f.cert, f.key, f.ca if files is None else self.files[task].ca)


def start_shard(tmp: pathlib.Path) -> Shard:
    """A secure shard with a job on it; the caller stops `local` and closes `chief`."""
    files = make_job_credentials(tmp / "job", PLACEHOLDER)
    foreign = make_job_credentials(tmp / "other-ca", PLACEHOLDER)
    checkpoint_dir = tmp / "checkpoints"
    f = files[PS]
    local = LocalCluster(1, server_args=["--tls-cert", str(f.cert), "--tls-key", str(f.key), "--tls-ca", str(f.ca),
                                         "--token-file", str(f.token), "--admin-token-file", str(f.admin_token),
                                         "--checkpoint-dir", str(checkpoint_dir)])
    local.start()
    try:
        c = files[CHIEF]
        chief = PSClient(local.cluster, task=CHIEF, connect_timeout=DEADLINE, timeout=DEADLINE, security=Security.load(
            tls_cert=str(c.cert), tls_key=str(c.key), tls_ca=str(c.ca), token_file=str(c.token),
            admin_token_file=str(c.admin_token), environ={}))
        chief.configure("async", lease_seconds=LONG, startup_grace_seconds=LONG, progress_seconds=LONG)
        chief.create_variables({"w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        DataQueue(chief, "q").create(10, 5)
        tokens = {"job": c.token.read_text().strip(), "admin": c.admin_token.read_text().strip()}
        shard = Shard(local, files, foreign, chief, checkpoint_dir, ps_pb2.CommitRequest(), tokens)
        with shard.as_task(WORKER1) as worker:
            joined = call(worker, METHODS["Join"], [ps_pb2.WorkerRef(worker="worker:1", incarnation=INCARNATION)],
                          tokens["job"])
            pushed = call(worker, METHODS["Push"], requests_for(shard)["Push"], tokens["job"])
        assert joined[0] == pushed[0] == grpc.StatusCode.OK, (joined, pushed)
        assert chief.save_checkpoint(1) == 1
        chief.create_tables([table_spec("t")])  # after the save: commit_again re-commits a checkpoint without it
        (manifest_path,) = checkpoint_dir.glob("step-*1/manifest.json")
        manifest = json.loads(manifest_path.read_text())
        shard.commit_again = ps_pb2.CommitRequest(
            step=1, keep=3, manifest_json=json.dumps({k: manifest[k] for k in ("strategy", "num_ps", "variables")}),
            shards=[ps_pb2.SaveResponse(index=s["index"], bytes=s["bytes"], step=s["state_step"])
                    for s in manifest["shards"]])
        return shard
    except BaseException:
        local.stop()
        raise


def files_under(folder: pathlib.Path) -> list[tuple]:
    """Every file under `folder`: (path, size, mtime, inode), sorted; a rewrite or an append shows."""
    out = []
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            st = path.stat()
            out.append((str(path.relative_to(folder)), st.st_size, st.st_mtime_ns, st.st_ino))
    return out


def snapshot(shard: Shard) -> dict:
    """What a served intruder's call could change, read with the chief's credentials."""
    if shard.local.procs[0].poll() is not None:
        return {"running": False}  # at once: an earlier case stopped the shard
    status = shard.chief.status(0)
    return {
        "running": shard.local.procs[0].poll() is None,
        "values": {name: value.tolist() for name, value in shard.chief.pull(["w"]).items()},
        "variables": [json_format.MessageToDict(info) for info in shard.chief.list_variables()],
        "status": {field: getattr(status, field) for field in STATUS_FIELDS},
        "config": json_format.MessageToDict(status.config),
        # What a table holds, and what pushes did to it (rows_read counts reads: not a change).
        "tables": [(t.name, t.rows, t.pending, t.bytes, t.optimizer_steps, t.rows_pushed) for t in status.tables],
        "files": files_under(shard.checkpoint_dir),
        "queues": {name: queue_state(shard.chief, name) for name in ("q", "intruder-queue")},
    }


def queue_state(chief: PSClient, name: str) -> dict | None:
    try:
        return json_format.MessageToDict(DataQueue(chief, name).status())
    except UnknownDataQueueError:
        return None


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """The module's shard, and its state before any intruder called: (Shard, snapshot)."""
    made = start_shard(tmp_path_factory.mktemp("secure-shard"))
    try:
        with made.chief:
            before = snapshot(made)
            assert before["status"]["step"] == 1 and before["status"]["live_workers"] == 1, before
            assert before["values"] == {"w": [-1.0, -1.0]} and before["config"]["mode"] == "async", before
            assert any(name.endswith("manifest.json") for name, *_ in before["files"]), before["files"]
            yield made, before
    finally:
        made.local.stop()


def changes(before: dict, after: dict) -> dict:
    """{what: (before, after)} for each part of a snapshot that differs."""
    return {key: (before.get(key), after.get(key)) for key in before.keys() | after.keys()
            if before.get(key) != after.get(key)}


# -- the matrix ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Intruder:
    """Who calls: a channel maker, the token sent, the status expected and words its details must hold."""

    name: str
    applies: object      # method name -> bool
    connect: object      # Shard -> grpc.Channel
    token: object        # Shard -> str | None
    code: grpc.StatusCode
    says: object         # method name -> words the details must hold


INTRUDERS = [
    Intruder("no-token", lambda m: True, lambda s: s.as_task(CHIEF), lambda s: None,
             grpc.StatusCode.UNAUTHENTICATED, lambda m: ["carries no token"]),
    Intruder("wrong-token", lambda m: True, lambda s: s.as_task(CHIEF), lambda s: s.tokens["job"][::-1],
             grpc.StatusCode.UNAUTHENTICATED, lambda m: ["carries a wrong token"]),
    Intruder("worker-admin", lambda m: m in ADMIN_METHODS, lambda s: s.as_task(WORKER0), lambda s: s.tokens["job"],
             grpc.StatusCode.PERMISSION_DENIED, lambda m: [f"refused {m} from worker:0", "the worker role"]),
    Intruder("evaluator", lambda m: m not in ROLES["evaluator"], lambda s: s.as_task(EVALUATOR),
             lambda s: s.tokens["job"], grpc.StatusCode.PERMISSION_DENIED,
             lambda m: [f"refused {m} from evaluator:0", "the evaluator role"]),
    Intruder("other-ca", lambda m: True, lambda s: s.as_task(CHIEF, s.foreign), lambda s: s.tokens["admin"],
             grpc.StatusCode.UNAVAILABLE, lambda m: ["failed to connect"]),
    Intruder("plaintext", lambda m: True, lambda s: channel(s.address, None, None, None), lambda s: s.tokens["admin"],
             grpc.StatusCode.UNAVAILABLE, lambda m: ["failed to connect"]),
]
CASES = [pytest.param(intruder, name, id=f"{intruder.name}-{name}")
         for intruder in INTRUDERS for name in METHODS if intruder.applies(name)]


@pytest.mark.parametrize("intruder,method", CASES)
def test_an_intruder_gets_its_status_and_changes_nothing(shard, intruder, method):
    made, before = shard
    with intruder.connect(made) as chan:
        code, details, replies = call(chan, METHODS[method], request(made, METHODS[method]), intruder.token(made))
    assert code == intruder.code, f"{intruder.name} calling {method}: {code} {details!r} {replies}"
    for words in intruder.says(method):
        assert words in details, details
    assert not changes(before, snapshot(made)), f"{intruder.name} calling {method} changed the shard"


def test_the_matrix_covers_every_rpc_and_role():
    assert set(METHODS) >= (ADMIN_METHODS | ROLES["worker"]) - REPLICA_METHODS, \
        "security.py names an RPC that ps.proto does not have"
    assert {m for i, m in (c.values for c in CASES) if i.name == "no-token"} == set(METHODS)
    assert {m for i, m in (c.values for c in CASES) if i.name == "worker-admin"} == ADMIN_METHODS - REPLICA_METHODS


def test_the_same_channels_serve_the_tasks_allowed(shard):
    """The channels and tokens the intruders use do work for a call their role allows: a refusal above is
    the shard's doing, not a broken channel."""
    made, before = shard
    for task, token in ((CHIEF, made.tokens["admin"]), (CHIEF, made.tokens["job"]), (WORKER0, made.tokens["job"]),
                        (EVALUATOR, made.tokens["job"])):
        with made.as_task(task) as chan:
            code, details, replies = call(chan, METHODS["GetStatus"], [ps_pb2.StatusRequest()], token)
        assert code == grpc.StatusCode.OK and replies[0].step == 1, (task, code, details)
    assert not changes(before, snapshot(made))


def test_an_evaluator_reads_rows_but_never_admits(shard):
    """LookupRows is an evaluator's too, but only to read: an admitting one (which may create rows of a dynamic
    table) is refused."""
    made, before = shard
    lookup = METHODS["LookupRows"]
    reading = ps_pb2.LookupRowsRequest(tables=[ps_pb2.TableIds(name="t", ids=struct.pack("<q", 1))])
    with made.as_task(EVALUATOR) as chan:
        code, details, replies = call(chan, lookup, [reading], made.tokens["job"])
        assert code == grpc.StatusCode.OK and replies, details
        admitting = ps_pb2.LookupRowsRequest(tables=reading.tables, admit=True)
        code, details, _ = call(chan, lookup, [admitting], made.tokens["job"])
    assert code == grpc.StatusCode.PERMISSION_DENIED and "evaluators read rows without admit" in details, details
    assert not changes(before, snapshot(made))


def test_a_worker_takes_data_shards_in_its_own_name_only(shard):
    """TakeDataShard is a worker's, but only for itself: worker:0 cannot take a shard in worker:1's name."""
    made, before = shard
    with made.as_task(WORKER0) as chan:
        code, details, _ = call(chan, METHODS["TakeDataShard"], requests_for(made)["TakeDataShard"],
                                made.tokens["job"])
    assert code == grpc.StatusCode.PERMISSION_DENIED and "acts in its own name only" in details, details
    assert not changes(before, snapshot(made))


def test_the_chiefs_own_requests_do_change_the_shard(tmp_path):
    """On a shard of its own: each request of the matrix, sent with the chief's credentials, is served and
    changes what snapshot() reads (but the reads, and Configure, see READS); Shutdown last stops it."""
    made = start_shard(tmp_path)
    try:
        with made.chief, made.as_task(CHIEF) as chan:
            # Leave last but for Shutdown: TakeDataShard hands worker:1 a shard while it is live.
            order = sorted(METHODS, key=lambda name: (name == "Shutdown", name == "Leave"))
            for name in order:
                before = snapshot(made)
                code, details, replies = call(chan, METHODS[name], request(made, METHODS[name]), made.tokens["admin"])
                if name == "Shutdown":
                    assert code == grpc.StatusCode.OK, details
                    assert made.local.procs[0].wait(timeout=30) == 0
                    continue
                if name == "Configure":
                    assert code == grpc.StatusCode.FAILED_PRECONDITION and "workers joined" in details, details
                    continue
                if name in REFUSED_FOR_THE_CHIEF:
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
                    assert REFUSED_FOR_THE_CHIEF[name] in details, details
                    assert not changes(before, snapshot(made)), name
                    continue
                assert code == grpc.StatusCode.OK, f"{name}: {code} {details} (a new RPC? see requests_for)"
                after = snapshot(made)
                if name in READS:
                    assert replies and not changes(before, after), name
                else:
                    assert changes(before, after), \
                        f"the chief's {name} changed nothing, an intruder's would not show: see requests_for and READS"
    finally:
        made.local.stop()


def test_a_token_table_without_an_admin_token_takes_roles_from_the_table(tmp_path):
    """Plaintext, per-task tokens and no --admin-token-file (issue 37, item 5: every token holder was the chief
    there): worker:0's own token is refused the admin RPCs of a live resize and of the optimizer, changing
    nothing; the chief's own token line is the chief's; the shard's log names the policy in force."""
    files = make_job_credentials(tmp_path / "job", PLACEHOLDER)
    with LocalCluster(1, server_args=["--token-file", str(files[PS].token)]) as local, \
            PSClient(local.cluster, task=CHIEF, connect_timeout=DEADLINE, timeout=DEADLINE,
                     security=Security.load(token_file=str(files[CHIEF].token), environ={})) as chief, \
            channel(local.cluster.ps[0], None, None, None) as chan:
        chief.configure("async", lease_seconds=LONG, startup_grace_seconds=LONG, progress_seconds=LONG)
        chief.create_variables({"w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        chief.push({"w": torch.ones(2)})

        def state() -> dict:
            status = chief.status(0)
            return {"values": chief.pull(["w"])["w"].tolist(), "status": {f: getattr(status, f) for f in STATUS_FIELDS},
                    "variables": [json_format.MessageToDict(info) for info in chief.list_variables()]}

        before = state()
        worker = files[WORKER0].token.read_text().strip()
        refused = {"UpdateOptimizer": [ps_pb2.UpdateOptimizerRequest(hyperparams={"lr": 5.0})],
                   "SetLayout": [ps_pb2.Layout(epoch=1, addresses=[local.cluster.ps[0]], placement={"w": 0})],
                   "ExportVariables": [ps_pb2.MoveRequest(names=["w"], epoch=1, to=0)]}
        for name, requests in refused.items():
            code, details, _ = call(chan, METHODS[name], requests, worker)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (name, code, details)
            assert f"refused {name} from worker:0: the worker role" in details, details
        assert state() == before, "a refused call changed the shard"
        code, details, _ = call(chan, METHODS["UpdateOptimizer"], refused["UpdateOptimizer"],
                                files[CHIEF].token.read_text().strip())
        assert code == grpc.StatusCode.OK, details
        assert "security policy: plaintext, per-task tokens" in local.log(0)
        assert "the chief's own token line makes the chief" in local.log(0)
