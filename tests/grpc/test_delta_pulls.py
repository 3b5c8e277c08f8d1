"""Delta pulls against real shards: a worker's copy equals the shard's, bit for bit (torch.equal after every
step), async and sync, across a shard restart and a re-layout, and when its version is too old or unknown
(then the variable comes whole); bad input is refused and changes nothing.

Each test checks that its scenario happened: deltas arrived (WorkerStats.delta_tensors moved) where they
should, and did not where the pull must be whole. Nothing is ordered by sleeping.
"""

from __future__ import annotations

import signal
import threading

import grpc
import pytest
import torch
import torch.nn.functional as F

from torchps import codec
from torchps.client import Compression, Optimizer, PSClient, PullBases, TaskSpec
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.worker.local_cluster import LocalCluster

TIMEOUT = 60.0
MIN = codec.MIN_CHUNK_BYTES
ROWS = 8000  # the embedding-like layer: 8000 x 32 float32 = 1 MB, cut in 2 pieces on 2 shards (3 on 3)


class Model(torch.nn.Module):
    """An embedding-like dense layer (a batch's gradient touches its rows only) and a dense head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.table = torch.nn.Embedding(ROWS, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, ids):
        return self.head(self.table(ids).mean(1))


def train_step(model: Model, binding, seed: int) -> int:
    generator = torch.Generator().manual_seed(seed)
    ids, y = torch.randint(0, ROWS, (16, 5), generator=generator), torch.randint(0, 4, (16,), generator=generator)
    model.zero_grad()
    F.cross_entropy(model(ids), y).backward()
    return binding.exchange()


def assert_holds(model: Model, values: dict[str, torch.Tensor], what: str) -> None:
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), values[name]), f"{what}: {name} differs from the shard's"


def run_both(train) -> None:
    """train(0) and train(1) in two threads at once; the first error is raised here, a hang fails."""
    errors = []

    def guarded(i: int) -> None:
        try:
            train(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


@pytest.fixture(scope="module")
def local():
    with LocalCluster(2, workers=2) as cluster:
        yield cluster


def worker(local, index: int, **kwargs) -> PSClient:
    return PSClient(local.cluster, task=TaskSpec("worker", index), timeout=TIMEOUT, **{"connect_timeout": 20, **kwargs})


@pytest.mark.parametrize("chunk_bytes", [1 << 20, MIN], ids=["push_pull", "push_then_pull"])
def test_async_workers_keep_copies_equal_to_the_shards_by_deltas(local, chunk_bytes):
    """Two workers take turns; after each one's exchange its copy equals what the shards hold."""
    prefix = f"async{chunk_bytes}/"
    models = [Model(seed=0), Model(seed=1)]
    with worker(local, 0, chunk_bytes=chunk_bytes) as w0, worker(local, 1, chunk_bytes=chunk_bytes) as w1, \
            PSClient(local.cluster, connect_timeout=20) as observer:
        bindings = [w0.register_module(models[0], Optimizer("sgd", lr=0.5), prefix=prefix, create=True,
                                       delta_pulls=True),
                    w1.register_module(models[1], Optimizer("sgd", lr=0.5), prefix=prefix, create=False,
                                       delta_pulls=True)]
        names = bindings[0].names
        observer.declare(w0.pull(names))
        received = [0, 0]
        for step in range(8):
            for i, (client, model, binding) in enumerate(zip((w0, w1), models, bindings)):
                before = client.stats.bytes_received
                train_step(model, binding, seed=10 * step + i)
                received[i] += client.stats.bytes_received - before
                assert_holds(model, {n.removeprefix(prefix): v for n, v in observer.pull(names).items()},
                             f"step {step}, worker {i}")
        for i, client in enumerate((w0, w1)):  # the first exchange is whole: registered at version 0, no base
            assert client.stats.delta_tensors >= 7 * 2, f"worker {i}: the table's pieces came as deltas"
            whole = 8 * sum(p.numel() * 4 for p in models[i].parameters())
            assert received[i] < whole / 3, f"worker {i} received {received[i]} bytes, whole pulls {whole}"


def test_concurrent_async_workers_end_equal_to_the_shards(local):
    """Both workers train at once (each shard applies their pushes in whatever order they come); a last
    delta pull leaves each copy equal to the shards'."""
    prefix = "concurrent/"
    models = [Model(seed=0), Model(seed=1)]
    with worker(local, 0) as w0, worker(local, 1) as w1, PSClient(local.cluster, connect_timeout=20) as observer:
        bindings = [w0.register_module(models[0], Optimizer("adagrad", lr=0.1), prefix=prefix, create=True,
                                       delta_pulls=True),
                    w1.register_module(models[1], Optimizer("adagrad", lr=0.1), prefix=prefix, create=False,
                                       delta_pulls=True)]

        def train(i: int) -> None:
            for step in range(12):
                train_step(models[i], bindings[i], seed=100 * i + step)

        run_both(train)
        observer.declare(w0.pull(bindings[0].names))
        final = {n.removeprefix(prefix): v for n, v in observer.pull(bindings[0].names).items()}
        for model, binding, client in zip(models, bindings, (w0, w1)):
            binding.pull()
            assert_holds(model, final, "after the last pull")
            assert client.stats.delta_tensors > 0


def test_sync_workers_hold_the_same_values_each_step_by_deltas():
    """Sync mode (2 replicas, top-k pushes summed on the shard): after each released step both workers hold
    the same values, and at the end the shards' values."""
    with LocalCluster(1, workers=2) as local:
        models = [Model(seed=0), Model(seed=1)]
        topk = Compression("topk", ratio=0.01, min_bytes=0)
        with worker(local, 0) as w0, worker(local, 1) as w1, PSClient(local.cluster, connect_timeout=20) as observer:
            w0.configure("sync", total_num_replicas=2)
            bindings = [w0.register_module(models[0], Optimizer("sgd", lr=0.5), create=True, delta_pulls=True,
                                           compression=topk)]
            bindings.append(w1.register_module(models[1], Optimizer("sgd", lr=0.5), create=False, delta_pulls=True,
                                               compression=topk))
            seen: list[list[dict]] = [[], []]

            def train(i: int) -> None:
                for step in range(6):
                    train_step(models[i], bindings[i], seed=100 * i + step)
                    seen[i].append({n: p.detach().clone() for n, p in models[i].named_parameters()})

            run_both(train)
            for step, (mine, theirs) in enumerate(zip(*seen)):
                for name in mine:
                    assert torch.equal(mine[name], theirs[name]), f"step {step}: {name}"
            observer.declare(w0.pull(bindings[0].names))
            assert_holds(models[0], observer.pull(bindings[0].names), "after the last step")
            assert w0.stats.delta_tensors > 0 and w1.stats.delta_tensors > 0


def test_a_restarted_shard_sends_everything_whole_once_then_deltas_again(tmp_path):
    """SIGKILL and restart (the journal brings every acknowledged push back): the next pull names the old
    generation, so it is whole; the ones after are deltas again; every step equals the shard."""
    with LocalCluster(1, workers=1, server_args=["--checkpoint-dir", str(tmp_path)]) as local:
        model = Model()
        with worker(local, 0, connect_timeout=60) as w0, PSClient(local.cluster, connect_timeout=60) as observer:
            binding = w0.register_module(model, Optimizer("sgd", lr=0.5), create=True, delta_pulls=True)
            observer.declare(w0.pull(binding.names))
            for step in range(3):
                train_step(model, binding, seed=step)
            deltas = w0.stats.delta_tensors
            assert deltas > 0
            assert local.kill_ps(0) == -signal.SIGKILL
            local.start_ps(0)
            train_step(model, binding, seed=3)
            assert w0.stats.delta_tensors == deltas, "the first pull after the restart is whole"
            assert_holds(model, observer.pull(binding.names), "after the restart")
            for step in range(4, 6):
                train_step(model, binding, seed=step)
                assert_holds(model, observer.pull(binding.names), f"step {step}")
            assert w0.stats.delta_tensors > deltas


def test_a_relayout_onto_another_shard_count_is_pulled_whole_then_by_deltas(tmp_path):
    """Bases kept from 2 shards name pieces and generations that no longer exist on 3: whole, then deltas."""
    source = tmp_path / "two"
    targets = {"emb": torch.zeros(ROWS, 32), "bias": torch.zeros(7)}
    bases = PullBases()
    with LocalCluster(2, server_args=["--checkpoint-dir", str(source)]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        client.create_variables({"emb": torch.randn(ROWS, 32), "bias": torch.randn(7)}, Optimizer("sgd", lr=1.0))
        for k in range(3):
            client.push(sparse_rows(k))
            client.pull_into(targets, bases=bases)
        assert client.stats.delta_tensors > 0
        client.save_checkpoint(0)
        saved = client.pull(list(targets))
    new_dir = tmp_path / "three"
    new_dir.mkdir()
    args = ["--restore-from", str(source), "--num-ps", "3", "--checkpoint-dir", str(new_dir)]
    with LocalCluster(3, server_args=args) as local, PSClient(local.cluster, connect_timeout=20) as client:
        client.declare(saved)
        assert len(client.partitions.wire_names(["emb"])) == 3, "re-cut for 3 shards"
        client.pull_into(targets, bases=bases)
        assert client.stats.delta_tensors == 0, "whole: other pieces, other generations"
        assert all(torch.equal(targets[n], saved[n]) for n in saved)
        for k in range(3, 6):
            client.push(sparse_rows(k))
            client.pull_into(targets, bases=bases)
            now = client.pull(list(targets))
            assert all(torch.equal(targets[n], now[n]) for n in now), f"push {k}"
        assert client.stats.delta_tensors > 0


def sparse_rows(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    emb = torch.zeros(ROWS, 32)
    emb[torch.randint(0, ROWS, (20,), generator=generator)] = torch.randn(20, 32, generator=generator)
    return {"emb": emb, "bias": torch.zeros(7)}


def test_a_worker_too_far_behind_pulls_whole(local):
    """The shard keeps an eighth of a variable's elements in changes; a base older than that is answered
    whole, and the copy is right."""
    name = "behind/w"
    with worker(local, 0, partitioner=None) as reader, worker(local, 1, partitioner=None) as writer:
        reader.create_variables({name: torch.randn(8000)}, Optimizer("sgd", lr=1.0))
        writer.declare({name: torch.zeros(8000)})
        copy = {name: torch.zeros(8000)}
        bases = PullBases()
        writer.push(sparse_flat(0, 8000, 100))
        reader.pull_into(copy, bases=bases)  # starts the shard's record: whole
        writer.push(sparse_flat(1, 8000, 100))
        reader.pull_into(copy, bases=bases)
        assert reader.stats.delta_tensors == 1
        for k in range(2, 8):  # 1800 changes since the reader's version, past the 8000 / 8 the shard keeps
            writer.push(sparse_flat(k, 8000, 300))
        received = reader.stats.bytes_received
        reader.pull_into(copy, bases=bases)
        assert reader.stats.delta_tensors == 1, "too old: whole"
        assert reader.stats.bytes_received - received == 8000 * 4
        assert torch.equal(copy[name], writer.pull([name])[name])


def sparse_flat(seed: int, n: int, count: int, name: str = "behind/w") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    grad = torch.zeros(n)
    grad[torch.randperm(n, generator=generator)[:count]] = torch.randn(count, generator=generator)
    return {name: grad}


def test_a_parameter_written_locally_is_pulled_whole_next_time(local):
    """An in-place write to a parameter (its version counter moves) makes the binding forget its base."""
    prefix = "local-write/"
    model = Model()
    with worker(local, 0) as w0, PSClient(local.cluster, connect_timeout=20) as observer:
        binding = w0.register_module(model, Optimizer("sgd", lr=0.5), prefix=prefix, create=True, delta_pulls=True)
        observer.declare(w0.pull(binding.names))
        train_step(model, binding, seed=0)
        with torch.no_grad():
            model.table.weight.add_(1.0)  # not a pull: the next pull of the table must be whole
        train_step(model, binding, seed=1)
        assert_holds(model, {n.removeprefix(prefix): v for n, v in observer.pull(binding.names).items()},
                     "after a local write")


# -- the contract, through the generated stubs ------------------------------------------------------------

@pytest.fixture(scope="module")
def stub(local):
    channel = grpc.insecure_channel(local.cluster.ps[0])
    yield ps_pb2_grpc.ParameterServerStub(channel)
    channel.close()


def chunks_of(stub, request: ps_pb2.PullRequest) -> list[ps_pb2.TensorChunk]:
    return [chunk for reply in stub.Pull(request, timeout=TIMEOUT) for chunk in reply.chunks]


def test_the_shard_answers_a_base_it_knows_with_a_delta_and_any_other_whole(local, stub):
    name = "contract/w"
    with PSClient(local.cluster, partitioner=None, connect_timeout=20) as client:
        client.create_variables({name: torch.zeros(1000)}, Optimizer("sgd", lr=1.0))
        assert client.placement.shard_of(name) == 0  # a new client places its first variable on ps 0
        grad = torch.zeros(1000)
        grad[[5, 500]] = 1.0
        client.push({name: grad})
        generation = client.status(0).generation
        first = chunks_of(stub, ps_pb2.PullRequest(names=[name], base_versions=[1], base_generation=generation))
        assert first[0].meta.encoding == ps_pb2.DENSE, "the first request for a delta starts the record: whole"
        client.push({name: grad})
        (delta,) = chunks_of(stub, ps_pb2.PullRequest(names=[name], base_versions=[1], base_generation=generation))
        assert (delta.meta.encoding, delta.meta.nnz, delta.version) == (ps_pb2.DELTA, 2, 2)
        index = torch.frombuffer(bytearray(delta.data[:8]), dtype=torch.int32)
        values = torch.frombuffer(bytearray(delta.data[8:]), dtype=torch.float32)
        assert index.tolist() == [5, 500] and values.tolist() == [-2.0, -2.0]
        (same,) = chunks_of(stub, ps_pb2.PullRequest(names=[name], base_versions=[2], base_generation=generation))
        assert (same.meta.encoding, same.meta.nnz, same.data) == (ps_pb2.DELTA, 0, b"")
        for versions, gen, why in (([1], generation + 1, "another generation"), ([9], generation, "a future version"),
                                   ([0], generation, "no base")):
            whole = chunks_of(stub, ps_pb2.PullRequest(names=[name], base_versions=versions, base_generation=gen))
            assert whole[0].meta.encoding == ps_pb2.DENSE and len(whole[0].data) == 4000, why


def test_bad_delta_input_is_refused_and_changes_nothing(local, stub):
    name = "contract/bad"
    with PSClient(local.cluster, partitioner=None, connect_timeout=20) as client:
        client.create_variables({name: torch.zeros(100)}, Optimizer("sgd", lr=1.0))
        assert client.placement.shard_of(name) == 0
        with pytest.raises(grpc.RpcError) as info:
            chunks_of(stub, ps_pb2.PullRequest(names=[name], base_versions=[1, 2]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "base_versions" in info.value.details()
        meta = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[100], encoding=ps_pb2.DELTA, nnz=1)
        data = torch.tensor([3], dtype=torch.int32).view(torch.uint8).tolist() + \
            torch.tensor([1.0]).view(torch.uint8).tolist()
        request = ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="w", step_increment=1),
                                     chunks=[ps_pb2.TensorChunk(name=name, meta=meta, data=bytes(data))])
        with pytest.raises(grpc.RpcError) as info:
            stub.Push(iter([request]), timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "DELTA" in info.value.details()
        (listed,) = stub.ListVariables(ps_pb2.ListRequest(names=[name]), timeout=TIMEOUT).variables
        assert listed.version == 0
