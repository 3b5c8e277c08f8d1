"""Embedding tables in sync mode, served by real shards (SyncReplicasOptimizer semantics for row gradients).

Two workers (threads of this process, each its own PSClient and model; one exchanges, one pushes then
pulls) train EmbeddingBags beside a dense layer with R = N = 2 and end where one plain torch process ends on
the combined batch (nn.EmbeddingBag(sparse=True) and torch.optim with the averaged gradient), rows touched
by one worker only and repeated ids included; a stale push carrying rows is dropped whole and a retried one
is added once. Sync mode no longer
refuses tables: every test here creates them in sync mode. Ordering is by events (replies, the shard's count
of waiting calls), never by sleeping.
"""

from __future__ import annotations

import struct
import threading

import grpc
import pytest
import torch
import torch.nn.functional as F
from helpers import wait_until
from torch import nn

from torchps import rows
from torchps.client import Embedding, EmbeddingBag, Optimizer, PSClient, TaskSpec
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server.embeddings import initial_rows

# torch.optim.Adagrad (the reference) builds sparse tensors without saying whether to check them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
N, D = 48, 4
UNTOUCHED = range(40, 48)  # no worker's batch names these ids (nor a few below 40, by chance)
TIMEOUT = 30.0
BAGS = {  # name -> (our module, torch's optimizer for its reference)
    "sgd": (lambda: EmbeddingBag(N, D, mode="sum", optimizer=Optimizer("sgd", lr=0.2)),
            lambda p: torch.optim.SGD(p, lr=0.2)),
    "adagrad": (lambda: EmbeddingBag(N, D, mode="mean", partition="hash", optimizer=Optimizer(
                    "adagrad", lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
                lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    "sparse_adam": (lambda: EmbeddingBag(N, D, mode="sum", optimizer=Optimizer("sparse_adam", lr=0.05,
                                                                               betas=(0.8, 0.99))),
                    lambda p: torch.optim.SparseAdam(p, lr=0.05, betas=(0.8, 0.99))),
    # dynamic: rows made at the first training lookup, as initial_rows(seed, id); max_age runs eviction
    # after every apply, and no row gets that old here
    "dynamic": (lambda: EmbeddingBag(None, D, mode="sum", max_age=100, optimizer=Optimizer("sgd", lr=0.2)),
                lambda p: torch.optim.SGD(p, lr=0.2)),
}


class _Model(nn.Module):
    def __init__(self, bags: dict[str, nn.Module]):
        super().__init__()
        self.bags = nn.ModuleDict(bags)
        self.head = nn.Linear(D * len(bags), 1)
        with torch.no_grad():  # the same start in every process: training stays tame
            self.head.weight.copy_(torch.linspace(-0.3, 0.3, D * len(bags))[None])
            self.head.bias.fill_(0.1)

    def forward(self, ids):
        return self.head(torch.cat([bag(ids) for bag in self.bags.values()], dim=1))


def _batches(worker: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Bags of 5 ids: worker 0's from [0, 25), worker 1's from [15, 40), so ids below 15 are worker 0's alone
    and 25-39 worker 1's alone; the first bag repeats an id."""
    gen = torch.Generator().manual_seed(worker)
    out = []
    for _ in range(steps):
        ids = torch.randint(15 * worker, 25 + 15 * worker, (4, 5), generator=gen)
        ids[0, 1] = ids[0, 0]
        out.append((ids, torch.randn(4, 1, generator=gen)))
    return out


def _rows_of(client: PSClient, name: str) -> torch.Tensor:
    return client.lookup_rows({name: torch.arange(N)}, admit=False)[name]


def test_two_sync_workers_train_tables_as_one_process_on_the_combined_batch(local_cluster):
    steps = 4
    local = local_cluster(2, workers=2)
    clients = [PSClient(local.cluster, task=TaskSpec("worker", i), connect_timeout=10.0, timeout=TIMEOUT)
               for i in range(2)]
    try:
        chief, other = clients
        chief.configure("sync", replicas_to_aggregate=2, total_num_replicas=2)  # before the tables: not refused
        models = [_Model({name: make() for name, (make, _) in BAGS.items()}) for _ in range(2)]
        bindings = [chief.register_module(models[0], Optimizer("sgd", lr=0.1), create=True),
                    other.register_module(models[1], Optimizer("sgd", lr=0.1), create=False,
                                          wait_timeout=TIMEOUT)]
        start = {}
        for name, bag in models[0].bags.items():
            start[name] = _rows_of(chief, bag.table_name)
            if bag.num_embeddings is None:  # nothing stored yet: the rows a first lookup makes
                assert torch.equal(start[name], torch.zeros(N, D))
                seed = chief.table_layout(bag.table_name).spec.init.seed
                start[name] = initial_rows(torch.arange(N).numpy(), D, seed=seed)
        reference = _Model({name: nn.EmbeddingBag.from_pretrained(start[name].clone(), freeze=False,
                                                                  mode=models[0].bags[name].mode, sparse=True)
                            for name in BAGS})
        optimizers = [make_opt(reference.bags[name].parameters()) for name, (_, make_opt) in BAGS.items()]
        optimizers.append(torch.optim.SGD(reference.head.parameters(), lr=0.1))

        batches = [_batches(i, steps) for i in range(2)]
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                for ids, target in batches[i]:
                    models[i].zero_grad()
                    F.mse_loss(models[i](ids), target).backward()
                    if i == 0:
                        bindings[i].exchange()  # PushPull: every shard replies once it applied the step
                    else:  # Push: every shard holds a push with rows until it applied the step, so the next
                        bindings[i].push()  # forward's lookups read the released step's rows on every shard
                        bindings[i].pull()
            except BaseException as exc:  # noqa: BLE001 - raised in the test thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT * 2)
        assert not any(t.is_alive() for t in threads), "a sync worker hung"
        if errors:
            raise errors[0]

        for k in range(steps):  # one process, the combined batch: the loss's mean is the two workers' average
            for opt in optimizers:
                opt.zero_grad()
            ids = torch.cat([batches[0][k][0], batches[1][k][0]])
            F.mse_loss(reference(ids), torch.cat([batches[0][k][1], batches[1][k][1]])).backward()
            for opt in optimizers:
                opt.step()

        assert [chief.status(s).step for s in range(2)] == [steps, steps]
        assert chief.status(0).stale_dropped == 0
        read = torch.unique(torch.cat([ids.flatten() for worker in batches for ids, _ in worker]))
        untouched = torch.tensor(sorted(set(range(N)) - set(read.tolist())))
        assert set(UNTOUCHED) <= set(untouched.tolist())
        pulled = chief.pull([f"head.{p}" for p in ("weight", "bias")])
        for p in ("weight", "bias"):
            torch.testing.assert_close(pulled[f"head.{p}"], getattr(reference.head, p).detach(), atol=1e-5, rtol=0)
        for name, bag in models[0].bags.items():
            got, expected = _rows_of(chief, bag.table_name), reference.bags[name].weight.detach()
            torch.testing.assert_close(got[read], expected[read], atol=1e-5, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
            only_0, only_1 = torch.arange(0, 15), torch.arange(25, 40)
            for alone in (only_0, only_1):  # rows one worker touched moved, by sum / 2 (the reference's)
                touched = alone[(got[alone] != start[name][alone]).any(dim=1)]
                assert len(touched) >= 5, f"{name}: too few rows touched by one worker alone moved"
            if bag.num_embeddings is None:
                assert torch.equal(got[untouched], torch.zeros(len(untouched), D)), "rows made that nobody read"
            else:
                assert torch.equal(got[untouched], start[name][untouched]), f"{name}: an untouched row moved"
            statuses = [next(t for t in chief.status(s).tables if t.name == bag.table_name) for s in range(2)]
            assert [s.optimizer_steps for s in statuses] == [steps, steps], "one optimizer step per sync step"
            assert all(s.evicted == 0 for s in statuses)
    finally:
        for client in clients:
            client.close()


# -- stale and retried pushes, straight through the generated stubs -----------------------------------------

def _request(client: PSClient, seq: int, step: int, w: list[float], ids: list[int],
             grads: list[list[float]]) -> ps_pb2.PushRequest:
    """A Push of dense "w" and rows of table "t" as `client` (its worker and incarnation) would send it."""
    encoded = rows.encode_rows(torch.tensor(ids, dtype=torch.int64), torch.tensor(grads, dtype=torch.float32))
    header = ps_pb2.PushHeader(worker=client.worker, incarnation=client.incarnation, seq=seq, step=step,
                               step_increment=1, tensors=2)
    return ps_pb2.PushRequest(header=header, chunks=[
        ps_pb2.TensorChunk(name="w", meta=ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[2]), offset=0,
                           data=struct.pack("<2f", *w)),
        ps_pb2.TensorChunk(name="t", meta=encoded.meta, offset=0, data=encoded.payload.numpy().tobytes())])


def test_a_retried_push_with_rows_is_added_once_and_a_stale_one_is_dropped_whole(local_cluster):
    local = local_cluster(1, workers=2)
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=10.0, timeout=TIMEOUT) as a, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=10.0, timeout=TIMEOUT) as b:
        a.configure("sync", total_num_replicas=2)
        assert a.create_tables([Embedding(N, D).table_spec("t", Optimizer("sgd", lr=1.0))]) == {"t": True}
        a.create_variables({"w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        b.wait_for_tables(["t"], TIMEOUT)
        b.declare({"w": torch.zeros(2)})
        a.join(), b.join()
        before = _rows_of(a, "t")
        channel = grpc.insecure_channel(local.cluster.ps[0])
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        try:
            request = _request(a, 1, 0, [1.0, 1.0], [1, 1, 3], [[1.0] * D, [1.0] * D, [2.0] * D])
            replies: dict[str, ps_pb2.PushResponse] = {}

            def send(key: str) -> None:
                replies[key] = stub.Push(iter([request]), timeout=TIMEOUT)

            original = threading.Thread(target=send, args=("original",), daemon=True)
            original.start()
            wait_until(lambda: a.status(0).waiting_calls >= 1, TIMEOUT, "the first push held for its step")
            retry = threading.Thread(target=send, args=("retry",), daemon=True)  # its reply was "lost"
            retry.start()
            wait_until(lambda: a.status(0).waiting_calls >= 2, TIMEOUT, "the retry waiting for the same release")
            assert a.status(0).step == 0, "the retry completed the step as if it were a second worker's push"
            b.push({"w": torch.full((2,), 3.0)}, rows={"t": (torch.tensor([3, 4]), torch.full((2, D), 4.0))})
            for t in (original, retry):
                t.join(TIMEOUT)
            assert not replies["original"].duplicate and replies["retry"].duplicate
            assert replies["original"].next_step == replies["retry"].next_step == 1

            after = _rows_of(a, "t")
            expected = before.clone()
            expected[1] -= 2.0 / 2  # repeats summed (1 + 1), one worker of two: / 2
            expected[3] -= (2.0 + 4.0) / 2
            expected[4] -= 4.0 / 2
            assert torch.equal(after, expected), "rows moved as if the retry were added (or a divisor is off)"
            assert torch.equal(a.pull(["w"])["w"], torch.full((2,), -2.0))
            (table,) = a.status(0).tables
            assert (table.optimizer_steps, table.rows_pushed) == (1, 5)

            stale = stub.Push(iter([_request(a, 2, 0, [9.0, 9.0], [5, 6], [[9.0] * D] * 2)]), timeout=TIMEOUT)
            assert stale.stale and stale.next_step == 1
            status = a.status(0)
            assert status.stale_dropped == 1 and status.step == 1 and status.duplicates == 1
            assert torch.equal(_rows_of(a, "t"), after), "a stale push's rows moved"
            assert torch.equal(a.pull(["w"])["w"], torch.full((2,), -2.0))
            assert a.status(0).tables[0].optimizer_steps == 1
        finally:
            channel.close()
