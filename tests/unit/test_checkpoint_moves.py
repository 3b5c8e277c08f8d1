"""A checkpoint holds every variable exactly once, wherever a live resize left it (ps_server/checkpoint.py).

Two shards in this process (Coordinators, no gRPC): "a" and "b" on ps 0, "c" on ps 1, each pushed to; then
a layout epoch places "b" on ps 1 and ps 0 exports it. Until ps 1 takes it in, "b" is only in ps 0's outbox;
once taken in, until ps 1 confirms it, it is in both.
"""

import pytest
import torch

from torchps.errors import CheckpointError
from torchps.ps_server import checkpoint
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.store import NewVariable, VariableStore

ADDRESSES = ["h:0", "h:1"]
MANIFEST = {"strategy": "round_robin", "num_ps": 2, "variables": [["a", 8], ["c", 8], ["b", 8]],
            "partitions": {"splits": {}}}


@pytest.fixture
def shards():
    ps = [Coordinator(VariableStore(), owns_step=index == 0, index=index) for index in range(2)]
    ps[0].create([NewVariable(n, torch.zeros(2), "sgd", {"lr": 1.0}) for n in ("a", "b")])
    ps[1].create([NewVariable("c", torch.zeros(2), "sgd", {"lr": 1.0})])
    for seq in range(1, 4):
        ps[0].push("worker:0", 1, seq, 0, {"a": torch.ones(2), "b": torch.ones(2)}, step_increment=1)
        ps[1].push("worker:0", 1, seq, 0, {"c": torch.ones(2)}, step_increment=1)
    for shard in ps:
        shard.moves.set_layout(1, ADDRESSES, {"a": 0, "b": 1, "c": 1})
    yield ps
    for shard in ps:
        shard.close()


def _save(directory, ps, step: int, epochs=None) -> list[tuple[int, int, int, int]]:
    shards = []
    for index, shard in enumerate(ps):
        state = shard.state(with_pending=False)
        _, size = checkpoint.write_shard(directory, index, step, state)
        epoch = state.get("layout", {}).get("epoch", 0) if epochs is None else epochs[index]
        shards.append((index, size, state["step"], epoch))
    return shards


def test_a_variable_in_an_outbox_is_checkpointed_and_restored_onto_any_count(shards, tmp_path):
    data, _ = shards[0].moves.export(["b"], 1, 1)
    checkpoint.commit(tmp_path, 3, MANIFEST, _save(tmp_path, shards, 3), keep=0)
    for count in (2, 3):
        restored = {entry["name"]: entry["value"] for index in range(count)
                    for entry in checkpoint.relayout(tmp_path, index, count)["variables"]}
        assert sorted(restored) == ["a", "b", "c"]
        assert all(torch.equal(value, torch.full((2,), -3.0)) for value in restored.values())
    shards[1].moves.import_(data, 1, 3)
    with pytest.raises(CheckpointError, match=r"variable 'b' is in the files of ps \[0, 1\]"):
        checkpoint.commit(tmp_path, 4, MANIFEST, _save(tmp_path, shards, 4), keep=0)
    assert shards[0].moves.confirm(["b"], 1) == ["b"]
    checkpoint.commit(tmp_path, 5, MANIFEST, _save(tmp_path, shards, 5), keep=0)
    assert checkpoint.latest_committed(tmp_path)[0] == 5


def test_shard_files_of_different_layout_epochs_or_missing_a_variable_are_not_committed(shards, tmp_path):
    with pytest.raises(CheckpointError, match=r"layout epochs \{0: 1, 1: 2\}"):
        checkpoint.commit(tmp_path, 3, MANIFEST, _save(tmp_path, shards, 3, epochs=[1, 2]), keep=0)
    with pytest.raises(CheckpointError, match="variable 'd' is in no shard file"):
        checkpoint.commit(tmp_path, 3, {**MANIFEST, "variables": [*MANIFEST["variables"], ["d", 8]]},
                          _save(tmp_path, shards, 3), keep=0)
    assert checkpoint.latest_committed(tmp_path) is None


def test_a_shard_file_of_another_checkpoint_in_a_committed_one_is_refused_at_restore(shards, tmp_path):
    """ps 1's file of checkpoint 3, copied over its file of checkpoint 6 (the same size: the manifest's byte
    count passes), holds another step than the manifest recorded for it: neither its own restore nor a
    re-layout onto another count takes it."""
    checkpoint.commit(tmp_path, 3, MANIFEST, _save(tmp_path, shards, 3), keep=0)
    for shard in shards:
        for seq in range(4, 7):
            shard.push("worker:0", 1, seq, 0, {n: torch.ones(2) for n in shard.store.names()}, step_increment=1)
    checkpoint.commit(tmp_path, 6, MANIFEST, _save(tmp_path, shards, 6), keep=0)
    old, new = (checkpoint.step_dir(tmp_path, s) / "ps-1.pt" for s in (3, 6))
    assert old.stat().st_size == new.stat().st_size
    new.write_bytes(old.read_bytes())
    assert checkpoint.restore_state(tmp_path, 0, 2)["step"] == 6  # ps 0's own file is its own
    for index, count in ((1, 2), (0, 3)):
        with pytest.raises(CheckpointError, match=r"ps-1.pt holds the state of step 3, and the manifest recorded 6"):
            checkpoint.restore_state(tmp_path, index, count)
