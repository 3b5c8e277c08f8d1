"""A checkpoint of embedding tables from 2 shards restored onto 3 and onto 1 (`ps-server --restore-from
--num-ps`), against real ps-server processes: every row, its optimizer state and a dynamic table's metadata
(last update step, occurrence counters) land on the shard the table's id partition names, none lost or
doubled, and training goes on exactly as on the 2 shards that saved it. Ordering is by replies only.
"""

from __future__ import annotations

import pathlib
import sys

import torch

from torchps import rows
from torchps.client import PSClient
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from table_job import assert_equal, at_once, everything, saved_tables, setup, step, table_specs  # noqa: E402


def rows_by_id(sections: list[list[dict]]) -> dict[str, dict[int, tuple]]:
    """{table: {id: (row, {optimizer state: row}, last update)}} over every shard's section; each id once."""
    out: dict[str, dict[int, tuple]] = {}
    for section in sections:
        for entry in section:
            s, table = entry["state"], out.setdefault(entry["name"], {})
            for i, key in enumerate(s["ids"].tolist()):
                assert key not in table, f"id {key} of {entry['name']!r} saved on two shards"
                table[key] = (s["values"][i], {k: v[i] for k, v in s["state"].items()},
                              int(s["last_update"][i]) if "last_update" in s else None)
    return out


def counters_by_id(sections: list[list[dict]]) -> dict[int, tuple[int, int]]:
    """The dynamic table's occurrence counters {id: (count, last seen step)} over every shard."""
    out = {}
    for section in sections:
        p = next(e for e in section if e["name"] == "dyn")["state"]["pending"]
        out.update({int(i): (int(c), int(s)) for i, c, s in zip(p["ids"], p["counts"], p["last_seen"])})
    return out


def test_tables_saved_on_2_shards_restore_onto_3_and_onto_1_by_their_partition_and_train_on(tmp_path):
    source = tmp_path / "two-shards"
    with LocalCluster(2, server_args=["--checkpoint-dir", str(source)]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        setup(client)
        for k in range(1, 5):
            step(client, k)
        assert client.save_checkpoint(0) == 4
        saved = saved_tables(source, 4)
        looked = step(client, 5)  # the uninterrupted run's next step
        after = everything(client)
    saved_rows, saved_counters = rows_by_id(saved), counters_by_id(saved)
    assert saved_counters and saved_rows["dyn"], "the test exercises admitted rows and pending counters"

    clusters = {num_ps: LocalCluster(num_ps, server_args=["--restore-from", str(source), "--num-ps", str(num_ps),
                                                          "--checkpoint-dir", str(tmp_path / f"{num_ps}-shards")])
                for num_ps in (3, 1)}
    try:
        at_once("start", *clusters.values())
        for num_ps, local in clusters.items():
            with PSClient(local.cluster, connect_timeout=20) as client:
                setup(client)  # the restored tables and variable are kept as they are
                assert [client.status(i).restored_step for i in range(num_ps)] == [4] * num_ps
                assert client.save_checkpoint(0) == 4
                sections = saved_tables(tmp_path / f"{num_ps}-shards", 4, num_ps)
                for index, section in enumerate(sections):
                    for entry, spec in zip(section, table_specs()):
                        ids, partition = entry["state"]["ids"], rows.partition_name(spec.partition)
                        assert (entry["shard_index"], entry["num_shards"]) == (index, num_ps)
                        assert bool((rows.shard_of(ids, num_ps, partition) == index).all()), \
                            f"{num_ps} shards: ps {index} holds rows of {entry['name']!r} another shard owns"
                        assert entry["state"]["optimizer_steps"] == 4, "the step count of Adagrad / SparseAdam"
                    pending = section[1]["state"]["pending"]["ids"]
                    assert bool((rows.shard_of(pending, num_ps, "modulo") == index).all())
                got = rows_by_id(sections)
                for table, want in saved_rows.items():
                    assert got[table].keys() == want.keys(), f"{num_ps} shards: {table!r} lost or gained rows"
                    for key, (value, state, age) in want.items():
                        value2, state2, age2 = got[table][key]
                        assert torch.equal(value, value2) and age == age2, (num_ps, table, key)
                        assert state.keys() == state2.keys() and all(torch.equal(state[k], state2[k]) for k in state)
                assert counters_by_id(sections) == saved_counters, f"{num_ps} shards: occurrence counters"

                assert_equal(step(client, 5), looked, f"{num_ps} shards: the next lookup")
                assert_equal(everything(client), after, f"{num_ps} shards: the next update")
    finally:
        at_once("stop", *clusters.values())
