"""A shard's memory: what GetStatus reports, gradients given back after each push, pulls without whole copies.

GetStatus reads the process's memory at most once a second (servicer.MEMORY_REFRESH_SECONDS), so a test waits
for the figures of an event to show instead of reading them once.
"""

import threading

import torch

from helpers import wait_until
from torchps.client import Compression, Optimizer, PSClient

MIB = 1 << 20


def test_status_reports_optimizer_state_and_the_process_memory(shared_cluster):
    with PSClient(shared_cluster.cluster, partitioner=None) as client:  # each variable whole on its shard
        client.create_variables({"mem/adam": torch.zeros(2 * MIB // 4)}, Optimizer("adam", lr=1e-3))
        client.create_variables({"mem/big": torch.zeros(8 * MIB // 4)}, Optimizer("sgd", lr=0.1))
        assert client.status(client.placement.shard_of("mem/adam")).state_bytes >= 2 * 2 * MIB  # Adam's two moments
        shard = client.placement.shard_of("mem/big")
        # An 8 MiB value is a block of its own (torchps.memory's threshold). The shard's RSS passes 8 MiB long
        # before (a shard forked from the fork server answers GetStatus, and caches its figures, at once).
        memory = wait_until(lambda: (lambda m: m if m.mapped_bytes >= 8 * MIB else None)(client.status(shard).memory),
                            20, "GetStatus's memory figures to show the 8 MiB variable as a block of its own")
        assert memory.peak_rss_bytes >= memory.rss_bytes > 8 * MIB
        assert memory.heap_in_use_bytes > 0


def test_a_shard_gives_a_push_s_gradient_memory_back(local_cluster):
    """With --keep-receive-buffers 0, pushes of a 64 MiB gradient leave the shard's RSS where creation left it
    (within half of one: a gradient kept would be a whole one; a loaded machine, gRPC buffering more of a stream
    at once, left 21 MiB of heap behind once, 5-8 MiB on a quiet one)."""
    local = local_cluster(1, server_args=["--keep-receive-buffers", "0"])
    with PSClient(local.cluster) as ps:
        ps.create_variables({"g": torch.zeros(64 * MIB // 4)}, Optimizer("sgd", lr=0.1))
        ps.pull(["g"])
        # The figures from after the creation (the value is a mapped block of its own), not cached from before.
        before = wait_until(lambda: (lambda m: m if m.mapped_bytes >= 64 * MIB else None)(ps.status(0).memory),
                            20, "GetStatus's memory figures to show the 64 MiB variable").rss_bytes
        grad = torch.full((64 * MIB // 4,), 1e-3)
        for _ in range(3):
            ps.push({"g": grad})
            ps.pull(["g"])
        seen = []

        def peaked():  # a gradient held whole shows in the peak (less what the shard freed meanwhile, such as
            seen[:] = [ps.status(0).memory]  # the pull's buffers: 61.6 MiB once in a loaded suite)
            return seen[0] if seen[0].peak_rss_bytes - before >= 48 * MIB else None
        try:
            after = wait_until(peaked, 20, "a push's gradient, held whole while it arrived, to show in the peak")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: RSS {before} before the pushes; last figures {seen[0]}") from None
        if after.rss_bytes - before >= 32 * MIB:  # figures read during the last push: take the next ones
            after = wait_until(lambda: (lambda m: m if m.rss_bytes - before < 32 * MIB else None)(ps.status(0).memory),
                               5, f"the pushes' memory to be given back (RSS {before} before, {after.rss_bytes} after)")
    assert after.rss_bytes - before < 32 * MIB, (before, after)
    assert after.kept_receive_bytes == 0 and after.receive_buffers_reused == 0


def test_a_shard_keeps_one_push_s_receive_buffer_and_lands_the_next_pushes_in_it(local_cluster):
    """By default a shard keeps as many free receive-buffer bytes as its variables hold: the 64 MiB gradient's
    buffer is kept after the first push and every later push lands in it (no fresh pages), and RSS stays
    within that one buffer of where creation left it."""
    local = local_cluster(1)
    with PSClient(local.cluster) as ps:
        ps.create_variables({"g": torch.zeros(64 * MIB // 4)}, Optimizer("sgd", lr=0.1))
        before = wait_until(lambda: (lambda m: m if m.mapped_bytes >= 64 * MIB else None)(ps.status(0).memory),
                            20, "GetStatus's memory figures to show the 64 MiB variable").rss_bytes
        grad = torch.full((64 * MIB // 4,), 1e-3)
        for _ in range(4):
            ps.push({"g": grad})
        memory = wait_until(lambda: (lambda m: m if m.receive_buffers_reused >= 3 else None)(ps.status(0).memory),
                            20, "GetStatus's figures to show the pushes after the first landing in its buffer")
        assert memory.kept_receive_bytes == 64 * MIB
        assert memory.rss_bytes - before < 64 * MIB + 32 * MIB, (before, memory)
        torch.testing.assert_close(ps.pull(["g"])["g"], torch.full((64 * MIB // 4,), -4 * 0.1 * 1e-3))


def test_kept_receive_buffers_count_against_max_memory_and_give_way_to_a_push(local_cluster):
    """Under --max-memory a kept buffer counts as held: with room for the 64 MiB variable and one gradient but not
    a kept one besides, each push takes the kept buffer's room back instead of being refused, and nothing is
    kept beyond the limit."""
    local = local_cluster(1, server_args=["--max-memory", str(150 * MIB)])
    with PSClient(local.cluster) as ps:
        ps.create_variables({"g": torch.zeros(64 * MIB // 4)}, Optimizer("sgd", lr=0.1))
        grad = torch.full((64 * MIB // 4,), 1e-3)
        for _ in range(3):
            ps.push({"g": grad})  # refused (ShardBusyError) if the kept buffer's room were not given back
            assert ps.status(0).memory.kept_receive_bytes == 64 * MIB  # 64 held + 64 kept <= 150
        torch.testing.assert_close(ps.pull(["g"])["g"], torch.full((64 * MIB // 4,), -3 * 0.1 * 1e-3))


def test_pulls_racing_pushes_always_get_one_version(local_cluster):
    """A 4 MiB variable goes out a chunk at a time while pushes change it: every pull is one version."""
    local = local_cluster(1)
    n = 4 * MIB // 4
    with PSClient(local.cluster) as ps, PSClient(local.cluster) as reader:
        ps.create_variables({"v": torch.zeros(n)}, Optimizer("sgd", lr=1.0))
        reader.declare([("v", n * 4)])
        done, stop = threading.Event(), threading.Event()
        versions = set()

        def push():
            ones = torch.ones(n)
            for _ in range(40):
                if stop.is_set():
                    break
                ps.push({"v": ones}, advance_step=False)
            done.set()

        pusher = threading.Thread(target=push)
        pusher.start()
        try:
            pulls = 0
            while not done.is_set() or pulls < 5:
                value = reader.pull(["v"])["v"]
                assert value.unique().numel() == 1, value.unique()
                versions.add(float(value[0]))
                pulls += 1
        finally:
            stop.set()
            pusher.join(60)
    assert len(versions) > 1  # the pulls did see the pushes land


def test_a_bf16_push_is_widened_into_a_kept_buffer(local_cluster):
    """A gradient pushed as bfloat16 is converted to its float32 variable's dtype in a receive buffer the shard
    keeps (the larger of the push's two buffers: the default keeps one push's worth, the variables' bytes), not
    in fresh memory each push."""
    local = local_cluster(1)
    with PSClient(local.cluster) as ps:
        ps.create_variables({"g": torch.zeros(16 * MIB // 4)}, Optimizer("sgd", lr=1.0))
        ps.set_compression({"g": Compression("bf16")})
        for _ in range(3):
            ps.push({"g": torch.full((16 * MIB // 4,), 0.5)})
        memory = wait_until(lambda: (lambda m: m if m.receive_buffers_reused >= 2 else None)(ps.status(0).memory),
                            20, "GetStatus's figures to show the later pushes widened into a kept buffer")
        assert memory.kept_receive_bytes == 16 * MIB  # the float32 buffer (the bfloat16 one is 8 MiB)
        torch.testing.assert_close(ps.pull(["g"])["g"], torch.full((16 * MIB // 4,), -1.5))
