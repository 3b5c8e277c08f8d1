"""deploy/cluster_commands.py: one TF_CONFIG and command per task."""

import importlib.util
import json
import pathlib
import shlex

from torchps.client import Cluster

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_module():
    spec = importlib.util.spec_from_file_location("cluster_commands", ROOT / "deploy" / "cluster_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_task_gets_the_cluster_and_its_own_task():
    cluster = Cluster(ps=["h3:2222", "h4:2222"], worker=["h1:2222"], chief=["h0:2222"])
    lines = load_module().commands(cluster, ["--mode", "sync", "--checkpoint-dir", "/ckpt"])
    assert [host for host, _ in lines] == ["h0", "h1", "h3", "h4"]
    seen = []
    for _, line in lines:
        env, *argv = shlex.split(line)
        config = json.loads(env.removeprefix("TF_CONFIG="))
        assert Cluster.from_dict(config) == cluster
        seen.append((config["task"]["type"], config["task"]["index"], argv))
    assert seen == [
        ("chief", 0, ["ps-worker", "--mode", "sync"]),
        ("worker", 0, ["ps-worker", "--mode", "sync"]),
        ("ps", 0, ["ps-server", "--checkpoint-dir", "/ckpt"]),
        ("ps", 1, ["ps-server", "--checkpoint-dir", "/ckpt"]),
    ]
