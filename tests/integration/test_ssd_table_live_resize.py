"""Tables kept on SSD in a live resize, against real ps-server processes: the job goes 2 -> 3 -> 2 shards while
training, each old shard streams the rows a new one owns from a frozen copy of its store (in chunks: the shards
send at most 64 KiB a message here), the new shard stages them on disk and builds its table there, and the job
trains on exactly as one whose table is in RAM and never resized (bit for bit, step by step). With journals, a
shard SIGKILLed right after it took a part of the rows comes back from its journal and the staged rows it names,
the resize goes on to its end, and the re-layout's folders go with the journal's next base; a checkpoint after
it restores onto 2 shards.

The reference is a RAM cluster given the same calls. Ordering is by replies, log lines a shard wrote and files
(waited for with a deadline), never by sleeping.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import re
import sys

import pytest
import torch

from torchps.client import Optimizer, PSClient
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from helpers import wait_until  # noqa: E402
from test_ssd_table_recovery import CACHE, DENSE, assert_equal, everything, specs, step, train_alike  # noqa: E402

WAIT = 120.0
SSD = ["--table-storage", "ssd", "--table-cache", CACHE, "--max-chunk-bytes", "65536"]
MORE = torch.arange(10_000, 30_000)  # ids admitted besides IDS: 1.4 MB of records, several messages a part


def _storage(client: PSClient, shards: int) -> list[dict[str, tuple[str, int]]]:
    """Each shard's {table: (storage, rows)}."""
    return [{t.name: (t.storage, t.rows) for t in client.status(s).tables} for s in range(shards)]


def _kept(spec, fixed: str):
    """`spec`, a fixed-size one asking for `fixed` storage ("ram": the shard's default)."""
    out = type(spec)()
    out.CopyFrom(spec)
    if spec.num_embeddings and fixed == "ssd":
        out.storage = "ssd"
    return out


def _newest_base(journal: pathlib.Path) -> int:
    return max(int(base.stem.partition("-")[2]) for base in journal.glob("base-*.bin"))


def _admit_more(*clients: PSClient) -> None:
    for client in clients:
        for _ in range(2):  # min_count 2
            client.lookup_rows({"dyn": MORE}, admit=True)


@pytest.mark.parametrize("fixed", ["ram", "ssd"], ids=["fixed-in-ram", "fixed-on-ssd"])
def test_a_table_on_ssd_moves_live_onto_3_shards_and_back_and_trains_on_exactly(tmp_path, fixed):
    """The dynamic table "dyn" is on SSD; the fixed-size "fix" in memory (the shards' default) or on SSD too
    (its spec asks for it)."""
    tables = tmp_path / "tables"
    ssd = LocalCluster(2, server_args=[*SSD, "--table-dir", str(tables)])
    ram = LocalCluster(2)
    with ssd, ram, PSClient(ssd.cluster, connect_timeout=30, chunk_bytes=65536) as chief, \
            PSClient(ram.cluster) as reference:
        for client, kept in ((chief, fixed), (reference, "ram")):
            client.create_variables({"w": torch.zeros(DENSE)}, Optimizer("sgd", lr=0.1))
            client.create_tables([_kept(spec, kept) for spec in specs()])
        for k in range(1, 4):
            assert_equal(step(chief, k), step(reference, k), f"step {k}'s lookup")
        _admit_more(chief, reference)
        grow = chief.resize([*ssd.cluster.ps, ssd.add_ps()])
        assert grow.shards_after == 3 and grow.table_bytes > 0
        held = _storage(chief, 3)
        assert [shard["dyn"][0] for shard in held] == ["ssd"] * 3 and all(shard["dyn"][1] > 0 for shard in held)
        assert [shard["fix"][0] for shard in held] == [fixed] * 3  # where it was kept, on every shard
        assert sum(shard["dyn"][1] for shard in held) == sum(t["dyn"][1] for t in _storage(reference, 2))
        streamed = re.findall(r"rows of tables on SSD streamed to ps \d+: \{'dyn': (\d+)[^}]*\} in (\d+) messages",
                              ssd.log(0))
        assert len(streamed) == 3 and all(int(messages) > 1 for _, messages in streamed), streamed
        for k in range(4, 7):
            assert_equal(step(chief, k), step(reference, k), f"step {k}'s lookup, on 3 shards")
        shrink = chief.resize(list(ssd.cluster.ps))
        assert shrink.shards_after == 2 and shrink.stopped == [ssd.address(2)]
        for k in range(7, 9):
            assert_equal(step(chief, k), step(reference, k), f"step {k}'s lookup, on 2 shards again")
        assert_equal(everything(chief), everything(reference), "every row and variable")
        assert_equal(chief.lookup_rows({"dyn": MORE}), reference.lookup_rows({"dyn": MORE}), "the rows admitted besides")
        left = [p for p in tables.glob("ps-*/relayout/*")]
        assert not left, f"the re-layouts' folders outlived them: {left}"


def test_a_shard_killed_after_taking_rows_of_a_table_on_ssd_comes_back_and_the_resize_ends(tmp_path):
    """ps 2, added, is SIGKILLed as soon as it logged an import of table rows (a part of ps 0's or ps 1's rows
    staged, acknowledged, named in its journal) and started again in place; the resize's driver sends what is
    left again and ends it, and the rows are those of the RAM reference. ps 0 is then killed too (it exported
    from a kept copy and built its own table). Training on until the journal of the shard holding the dense
    variable wrote a base drops the re-layout's folders there; a checkpoint then restores onto 2 shards,
    exactly."""
    checkpoints = tmp_path / "checkpoints"
    ssd = LocalCluster(2, server_args=[*SSD, "--table-dir", str(tmp_path / "tables"), "--checkpoint-dir",
                                       str(checkpoints)])
    ram = LocalCluster(2, server_args=["--no-journal"])
    with ssd, ram, PSClient(ssd.cluster, connect_timeout=60, chunk_bytes=65536) as chief, PSClient(ram.cluster) as reference:
        train_alike(chief, reference, 3)
        added = ssd.add_ps()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            growing = pool.submit(chief.resize, [*ssd.cluster.ps, added])
            wait_until(lambda: "embedding-table rows of ps" in ssd.log(2) or growing.done(), WAIT,
                       "ps 2's first import of table rows")
            assert not growing.done() or "embedding-table rows of ps" in ssd.log(2)
            ssd.kill_ps(2)
            killed_log = ssd.log(2)
            ssd.start_ps(2)
            grow = growing.result(timeout=WAIT)
        journals = [checkpoints / "journal" / f"ps-{i}" for i in range(3)]
        at_end = [_newest_base(journal) for journal in journals]  # the resize's end is in this log or the next
        assert grow.shards_after == 3 and grow.outcome == "done"
        took = re.findall(r"embedding-table rows of ps (\d) imported", killed_log)
        assert took, killed_log[-3000:]
        assert re.search(r"recovered from the journal .* (\d+) records replayed", ssd.log(2)), ssd.log(2)[-3000:]
        assert_equal(everything(chief), everything(reference), f"after ps 2 came back (it had taken {took})")
        for k in range(4, 6):
            assert_equal(step(chief, k), step(reference, k), f"step {k}'s lookup")
        ssd.kill_ps(0)
        ssd.start_ps(0)
        assert_equal(everything(chief), everything(reference), "after ps 0 came back")
        kept = [any((journal / "relayout").iterdir()) for journal in journals]
        assert all(kept[i] for i in range(3) if _newest_base(journals[i]) == at_end[i]), "no base yet: kept"

        def based_after_end(i: int) -> bool:  # a base written after the log that holds the resize's end
            return _newest_base(journals[i]) >= at_end[i] + 2

        dense = [i for i in range(3) if chief.status(i).num_variables]  # their logs grow by parts of "w" a step
        k = 6
        while not all(based_after_end(i) for i in dense) and k < 40:
            assert_equal(step(chief, k), step(reference, k), f"step {k}'s lookup")
            k += 1
        assert all(based_after_end(i) for i in dense), f"no base in {k - 6} steps of 1.2 MB"
        for i, journal in enumerate(journals):
            if based_after_end(i):
                assert not any((journal / "relayout").iterdir()), f"{journal.name}: outlived a base after the end"
            elif _newest_base(journal) == at_end[i]:
                assert any((journal / "relayout").iterdir()), f"{journal.name}: gone before a base after the end"
        chief.save_checkpoint(0)
        expected = everything(reference)
    back = LocalCluster(2, server_args=["--restore-from", str(checkpoints), "--num-ps", "2", "--table-storage", "ssd",
                                        "--table-dir", str(tmp_path / "back"), "--table-cache", CACHE])
    with back, PSClient(back.cluster, connect_timeout=30) as restored:
        restored.declare({"w": torch.zeros(DENSE)})
        restored.wait_for_tables(["dyn", "fix"], timeout=30)
        assert_equal(everything(restored), expected, "restored onto 2 shards")


@pytest.mark.parametrize("storage", ["ram", "ssd"])
def test_a_shard_removed_then_added_again_takes_the_rows_anew_not_its_stale_ones(tmp_path, storage):
    """2 -> 3 -> 2 -> 3 shards with journals: ps 2, removed, drops its part of the tables at the end of that
    re-layout (journaled); added again, it comes back from its journal holding none, so the next re-layout
    brings it the rows as they are now, trained meanwhile (the chaos soak found ps 2 serving its stale part,
    which it kept and was taken as already laid out over 3)."""
    flags = ["--checkpoint-dir", str(tmp_path / "ckpt"), *(["--table-storage", "ssd", "--table-dir",
                                                            str(tmp_path / "tables"), "--table-cache", CACHE]
                                                          if storage == "ssd" else [])]
    local, ram = LocalCluster(2, server_args=flags), LocalCluster(2, server_args=["--no-journal"])
    with local, ram, PSClient(local.cluster, connect_timeout=30) as chief, PSClient(ram.cluster) as reference:
        train_alike(chief, reference, 2)
        assert chief.resize([*local.cluster.ps, local.add_ps()]).shards_after == 3
        for k in range(3, 5):
            assert_equal(step(chief, k), step(reference, k), f"step {k}, on 3 shards")
        removed = chief.resize(list(local.cluster.ps))
        assert removed.stopped == [local.address(2)]
        assert local.procs[2].wait(WAIT) == 0
        for k in range(5, 8):  # rows ps 2 held change on the 2 shards
            assert_equal(step(chief, k), step(reference, k), f"step {k}, on 2 shards")
        assert chief.resize([*local.cluster.ps, local.add_ps(2)]).shards_after == 3
        assert "recovered from the journal" in local.log(2), "it came back with its journal, as the soak's did"
        assert_equal(everything(chief), everything(reference), "every row after ps 2 came back")
        assert_equal(step(chief, 8), step(reference, 8), "step 8, on 3 shards again")
