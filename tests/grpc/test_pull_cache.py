"""The pull cache against real shards: the pulls of one version share one copy (and one cast), bit for bit the
variable's, whether they come over a lane or inline; an update is never followed by stale bytes; the cache counts
against --max-memory and gives way to a push; --no-pull-cache turns it off.

Each check reads GetStatus's figures after the pulls it counts returned: the pulls are the events, no sleeps.
"""

from concurrent import futures

import pytest
import torch

from torchps.client import Compression, Optimizer, PSClient, TaskSpec

MIB = 1 << 20
N = 4 * MIB // 4  # float32 elements: 4 MiB, over the cache's 1 MiB and the client's lane threshold
TIMEOUT = 30.0


def memory(ps: PSClient):
    return ps.status(0).memory


@pytest.mark.parametrize("flags", [[], ["--no-pull-cache"]], ids=["cache", "no_cache"])
def test_sync_workers_pulling_one_version_share_one_copy_per_cast(local_cluster, flags):
    """Sync mode: two workers (one on a lane, one inline) pull the same version as float32, then as bfloat16;
    each gets the variable's bytes (Tensor.to's for the cast), and the second pull of each is a cache hit. Then
    three steps of bf16 pushes: after each, both workers pull the released version, the same bytes, the cast
    of the shard's value, and the second pull is a hit again."""
    local = local_cluster(1, workers=2, server_args=flags)
    value = torch.randn(N, generator=torch.Generator().manual_seed(0))
    with PSClient(local.cluster, task=TaskSpec("worker", 0), partitioner=None, timeout=TIMEOUT) as w0, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), partitioner=None, timeout=TIMEOUT,
                     lanes=False) as w1, PSClient(local.cluster, partitioner=None, timeout=TIMEOUT) as observer:
        workers = (w0, w1)
        w0.configure("sync", total_num_replicas=2)
        w0.create_variables({"v": value.clone()}, Optimizer("sgd", lr=1.0))
        w1.declare([("v", 4 * N)])
        observer.declare([("v", 4 * N)])
        targets = [torch.zeros(N), torch.zeros(N)]
        for cast, expected in ((None, value), ("bf16", value.to(torch.bfloat16).float())):
            for ps, target in zip(workers, targets):
                if cast:
                    ps.set_compression({"v": Compression(cast)})
                ps.pull_into({"v": target})
            assert torch.equal(targets[0], expected) and torch.equal(targets[1], expected), cast
        # w0's pulls went on a lane (a lane given up under load is retried on a new one), w1's never
        assert w0._lanes.opened >= 1 and w1._lanes.opened == 0
        for step in range(3):
            grads = [torch.randn(N, generator=torch.Generator().manual_seed(10 * step + i)) for i in range(2)]

            def train(i: int) -> None:
                workers[i].push({"v": grads[i]})
                workers[i].pull_into({"v": targets[i]}, min_step=workers[i].step)

            with futures.ThreadPoolExecutor(2) as pool:  # a sync step needs both workers' pushes
                for done in [pool.submit(train, i) for i in range(2)]:
                    done.result(timeout=2 * TIMEOUT)
            value -= (grads[0].to(torch.bfloat16).float() + grads[1].to(torch.bfloat16).float()) / 2
            exact = observer.pull(["v"])["v"]  # as stored: it makes the float32 entry, no hit
            torch.testing.assert_close(exact, value, rtol=0, atol=1e-5)  # the released step's value, not an older one
            assert torch.equal(targets[0], exact.to(torch.bfloat16).float()), step
            assert torch.equal(targets[1], targets[0]), step
        figures = memory(w0)
    if flags:
        assert figures.pull_cache_hits == 0 and figures.pull_cache_bytes == 0
    else:
        assert figures.pull_cache_hits == 2 + 3 and figures.pull_cache_bytes == 4 * N + 2 * N  # fp32, bf16 copies


def test_an_update_between_pulls_is_never_answered_with_the_cached_version(local_cluster):
    """Async mode caches a version at its third pull: the fourth is a hit; after a push the next pulls get
    the new version, as the two that counted it read it, and the third of them caches it anew."""
    local = local_cluster(1)
    with PSClient(local.cluster, partitioner=None, timeout=TIMEOUT) as ps:
        ps.create_variables({"v": torch.zeros(N)}, Optimizer("sgd", lr=1.0))
        target = torch.empty(N)
        for _ in range(4):
            ps.pull_into({"v": target})
        assert memory(ps).pull_cache_hits == 1 and torch.equal(target, torch.zeros(N))
        ps.push({"v": torch.ones(N)})
        for hits in (1, 1, 1, 2):
            target.fill_(7.0)
            ps.pull_into({"v": target})
            assert torch.equal(target, torch.full((N,), -1.0))
            assert memory(ps).pull_cache_hits == hits
        assert torch.equal(ps.pull(["v"])["v"], torch.full((N,), -1.0))  # inline too


def test_cached_bytes_count_against_max_memory_and_give_way_to_a_push(local_cluster):
    """--max-memory with room for the variable and one more copy of it: the cache takes that room, and a push,
    whose gradient needs it, takes it back instead of being refused; with less room nothing is cached."""
    size = 4 * N
    local = local_cluster(1, server_args=["--max-memory", str(size * 5 // 2), "--keep-receive-buffers", "0"])
    with PSClient(local.cluster, partitioner=None, timeout=10.0) as ps:  # a refused push is retried this long
        ps.create_variables({"v": torch.zeros(N)}, Optimizer("sgd", lr=1.0))
        target = torch.empty(N)
        for _ in range(4):
            ps.pull_into({"v": target})
        figures = memory(ps)
        assert figures.pull_cache_bytes == size and figures.pull_cache_hits == 1
        ps.push({"v": torch.ones(N)})  # 3 x size past the limit with the cached copy: it makes room
        assert memory(ps).pull_cache_bytes == 0
        ps.pull_into({"v": target})
        assert torch.equal(target, torch.full((N,), -1.0))
    local = local_cluster(1, server_args=["--max-memory", str(size * 3 // 2)])
    with PSClient(local.cluster, partitioner=None, timeout=TIMEOUT) as ps:
        ps.create_variables({"v": torch.zeros(N)}, Optimizer("sgd", lr=1.0))
        for _ in range(4):
            ps.pull_into({"v": target})
        figures = memory(ps)
        assert figures.pull_cache_bytes == 0 and figures.pull_cache_hits == 0
        assert torch.equal(target, torch.zeros(N))
