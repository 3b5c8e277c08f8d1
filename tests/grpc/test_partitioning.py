"""Variables cut along axis 0 across real shards: every client call still sees whole variables."""

import gc

import torch

from torchps import codec
from torchps.client import MinSizePartitioner, Optimizer, PSClient, TaskSpec
from torchps.worker.local_cluster import LocalCluster

ADAM = Optimizer("adam", lr=1e-2)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))


def pieces_per_shard(client: PSClient) -> list[list[str]]:
    return [sorted(info.spec.name for info in client._fanout.channels.call(
        shard, lambda stub, t: stub.ListVariables(__import__("torchps.proto.ps_pb2", fromlist=["x"]).ListRequest(),
                                                  timeout=t), 10).variables) for shard in range(client.cluster.num_ps)]


def test_a_big_layer_is_cut_across_4_shards_and_trains_as_one_tensor(local_cluster):
    """The 6.4 MB weight goes to 4 shards in 4 pieces; modules, push, exchange, export and a second worker
    see whole tensors, and server-side Adam over the pieces is torch.optim.Adam over the whole, exactly."""
    local = local_cluster(4)
    model, reference = make_model(0), make_model(0)
    local_adam = torch.optim.Adam(reference.parameters(), lr=1e-2)
    with PSClient(local.cluster, task=TaskSpec("worker", 0)) as chief, \
            PSClient(local.cluster, task=TaskSpec("worker", 1)) as worker:
        binding = chief.register_module(model, ADAM, create=True)
        held = pieces_per_shard(chief)
        assert [sorted(n for n in names if n.startswith("0.weight")) for names in held] == \
            [[f"0.weight/part_{i}"] for i in range(4)], held
        assert sum(len(names) for names in held) == 7  # 4 pieces + three small whole variables
        report = chief.placement_report()
        assert "0.weight [2048, 784] in 4 pieces: part_0 rows 0-511" in report, report

        other = make_model(1)
        other_binding = worker.register_module(other, ADAM, create=False)  # waits for the chief's pieces, pulls whole
        assert all(torch.equal(a, b) for a, b in zip(other.parameters(), reference.parameters()))

        x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
        for step in range(3):
            for net in (model, reference):
                net.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
            local_adam.step()
            binding.exchange() if step % 2 else (binding.push(), binding.pull())
            for (name, got), want in zip(model.named_parameters(), reference.parameters()):
                assert torch.equal(got, want), f"step {step}: {name} differs by {(got - want).abs().max():.3g}"

        exported = worker.export_state_dict()
        assert list(exported) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        fresh = make_model(2)
        fresh.load_state_dict(exported)
        assert torch.equal(fresh(x), reference(x))
        other_binding.pull()
        assert torch.equal(other[0].weight, reference[0].weight)
        assert chief.set_hyperparams(["0.weight"], lr=0.0) == 4  # one per piece


def test_a_variable_of_1024_chunks_on_4_shards_round_trips(local_cluster):
    """create -> pull -> push -> pull of one variable cut in 4 pieces of 256 chunks each: a 1 GiB variable's
    pieces at the default 1 MiB chunks, here 64 MiB at the smallest chunk a shard takes (64 KiB), so that every
    piece crosses as many chunks, messages and lane frames for a sixteenth of the bytes."""
    local = local_cluster(4)
    rows, cols = 1 << 12, 1 << 12  # 2^24 float32 elements: 64 MiB, 1024 chunks of MIN_CHUNK_BYTES
    with PSClient(local.cluster, timeout=600, chunk_bytes=codec.MIN_CHUNK_BYTES) as client:
        value = torch.arange(rows, dtype=torch.float32).unsqueeze(1).expand(rows, cols).contiguous()
        client.create_variables({"huge": value}, Optimizer("sgd", lr=1.0))
        assert [info.nbytes for info in client.list_variables()] == [256 * codec.MIN_CHUNK_BYTES] * 4
        pulled = client.pull(["huge"])["huge"]
        assert torch.equal(pulled, value)
        del pulled
        gc.collect()
        client.push({"huge": torch.ones(rows, cols)})
        value -= 1
        target = torch.zeros(rows, cols)
        client.pull_into({"huge": target})  # each piece lands in its rows of the target, in place
        assert torch.equal(target, value)


def test_a_checkpoint_of_pieces_restores_onto_3_and_onto_1_shards_with_adam_state(tmp_path):
    """Saved from 2 shards (2 pieces), restored onto 3 (3 pieces) and 1 (whole): the values are the saved
    ones and the next update is the one the job would have made, so Adam's moments were cut again too."""
    source = tmp_path / "two"
    partitioner = MinSizePartitioner(min_shard_bytes=8)  # one piece per shard: 2, then 3 (w) or 2 (b), then whole
    grads = [{"w": torch.randn(10, 5, generator=torch.Generator().manual_seed(k)),
              "b": torch.randn(5, generator=torch.Generator().manual_seed(100 + k))} for k in range(4)]
    initial = {"w": torch.randn(10, 5), "b": torch.zeros(5)}
    with LocalCluster(2, server_args=["--checkpoint-dir", str(source)]) as local, \
            PSClient(local.cluster, partitioner=partitioner) as client:
        client.create_variables(initial, ADAM)
        for grad in grads[:3]:
            client.push(grad)
        client.save_checkpoint(0)
        saved = client.pull(["w", "b"])
        client.push(grads[3])
        uninterrupted = client.pull(["w", "b"])

    for num_ps in (3, 1):
        new_dir = tmp_path / f"{num_ps}"
        new_dir.mkdir()
        args = ["--restore-from", str(source), "--num-ps", str(num_ps), "--checkpoint-dir", str(new_dir)]
        with LocalCluster(num_ps, server_args=args) as local, \
                PSClient(local.cluster, partitioner=partitioner) as client:
            client.create_variables({name: torch.zeros_like(v) for name, v in initial.items()}, ADAM)
            names = sorted(info.spec.name for info in client.list_variables())
            assert names == (["b/part_0", "b/part_1", "w/part_0", "w/part_1", "w/part_2"]
                             if num_ps == 3 else ["b", "w"]), names
            got = client.pull(["w", "b"])
            assert all(torch.equal(got[n], saved[n]) for n in saved), f"{num_ps} shards: restored values"
            client.push(grads[3])
            got = client.pull(["w", "b"])
            assert all(torch.equal(got[n], uninterrupted[n]) for n in saved), f"{num_ps} shards: next update"
