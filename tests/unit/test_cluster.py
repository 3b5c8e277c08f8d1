"""Cluster: parsing TF_CONFIG-shaped JSON, validation, and the chief."""

import json

import pytest

from torchps.cluster import Cluster, TaskSpec
from torchps.errors import ClusterConfigError

SPEC = {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"], "ps": ["h3:2222", "h4:2223"]}


def test_from_dict_fills_every_type_in_order():
    """Addresses keep their order; absent types are empty tuples."""
    cluster = Cluster.from_dict(SPEC)
    assert cluster.ps == ("h3:2222", "h4:2223")
    assert cluster.worker == ("h1:2222", "h2:2222")
    assert cluster.chief == ("h0:2222",)
    assert cluster.evaluator == ()
    assert cluster.num_ps == 2
    assert cluster.address(TaskSpec("worker", 1)) == "h2:2222"


def test_from_dict_accepts_a_whole_tf_config():
    """A dict with a 'cluster' key is unwrapped (the task is ignored)."""
    assert Cluster.from_dict({"cluster": SPEC, "task": {"type": "ps", "index": 0}}) == Cluster.from_dict(SPEC)


def test_from_json_inline_and_file(tmp_path):
    """Inline JSON and a path to a JSON file give the same cluster."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(SPEC))
    assert Cluster.from_json(json.dumps(SPEC)) == Cluster.from_dict(SPEC)
    assert Cluster.from_json(str(path)) == Cluster.from_dict(SPEC)
    assert Cluster.from_json("  " + json.dumps({"ps": ["[::1]:5"]})).ps == ("[::1]:5",)


def test_from_json_missing_file(tmp_path):
    with pytest.raises(ClusterConfigError, match="neither inline JSON nor a readable file"):
        Cluster.from_json(str(tmp_path / "absent.json"))


def test_from_tf_config_with_task():
    """TF_CONFIG gives the cluster and the task."""
    env = {"TF_CONFIG": json.dumps({"cluster": SPEC, "task": {"type": "worker", "index": 1}})}
    cluster, task = Cluster.from_tf_config(env)
    assert cluster == Cluster.from_dict(SPEC)
    assert task == TaskSpec("worker", 1)
    assert str(task) == "worker:1"


def test_from_tf_config_without_task():
    cluster, task = Cluster.from_tf_config({"TF_CONFIG": json.dumps({"cluster": SPEC})})
    assert cluster.ps == ("h3:2222", "h4:2223")
    assert task is None


def test_from_tf_config_reads_os_environ(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}))
    assert Cluster.from_tf_config() == (Cluster(ps=("a:1",)), TaskSpec("ps", 0))


@pytest.mark.parametrize("env, match", [
    ({}, "TF_CONFIG is not set"),
    ({"TF_CONFIG": ""}, "TF_CONFIG is not set"),
    ({"TF_CONFIG": "{not json"}, "does not parse"),
    ({"TF_CONFIG": json.dumps({"task": {"type": "ps"}})}, "no 'cluster' key"),
    ({"TF_CONFIG": json.dumps([1, 2])}, "no 'cluster' key"),
    ({"TF_CONFIG": json.dumps({"cluster": SPEC, "task": {"index": 0}})}, "task must be"),
    ({"TF_CONFIG": json.dumps({"cluster": SPEC, "task": {"type": "worker", "index": "x"}})}, "task must be"),
])
def test_from_tf_config_errors(env, match):
    with pytest.raises(ClusterConfigError, match=match):
        Cluster.from_tf_config(env)


@pytest.mark.parametrize("task", [
    {"type": "worker", "index": 2},   # only two workers
    {"type": "ps", "index": -1},
    {"type": "evaluator", "index": 0},  # none in the cluster
])
def test_tf_config_task_index_out_of_range(task):
    with pytest.raises(ClusterConfigError, match="not in the cluster"):
        Cluster.from_tf_config({"TF_CONFIG": json.dumps({"cluster": SPEC, "task": task})})


def test_tf_config_unknown_task_type():
    env = {"TF_CONFIG": json.dumps({"cluster": SPEC, "task": {"type": "master", "index": 0}})}
    with pytest.raises(ClusterConfigError, match="unknown task type"):
        Cluster.from_tf_config(env)


def test_unparsable_json():
    with pytest.raises(ClusterConfigError, match="does not parse"):
        Cluster.from_json('{"ps": ["a:1"],}')


def test_not_an_object():
    with pytest.raises(ClusterConfigError, match="JSON object"):
        Cluster.from_dict(["a:1"])


def test_unknown_task_type():
    with pytest.raises(ClusterConfigError, match=r"unknown task type.*'master'"):
        Cluster.from_dict({"ps": ["a:1"], "master": ["b:1"]})


def test_duplicate_addresses():
    """The same address twice, within a type or across types, is refused and both tasks are named."""
    with pytest.raises(ClusterConfigError, match=r"a:1 is listed twice.*worker:0.*ps:0"):
        Cluster.from_dict({"ps": ["a:1"], "worker": ["a:1"]})
    with pytest.raises(ClusterConfigError, match="listed twice"):
        Cluster.from_dict({"ps": ["a:1", "a:1"]})


@pytest.mark.parametrize("address", ["localhost", "h:", ":2222", "h:abc", "h:70000", "h:-1", "h:22 "])
def test_malformed_address(address):
    with pytest.raises(ClusterConfigError, match="not 'host:port'"):
        Cluster.from_dict({"ps": [address]})


def test_addresses_must_be_a_list_of_strings():
    with pytest.raises(ClusterConfigError, match="list of 'host:port' strings"):
        Cluster(ps="a:1")
    with pytest.raises(ClusterConfigError, match="list of 'host:port' strings"):
        Cluster.from_dict({"ps": ["a:1", 2]})


def test_from_dict_a_bare_string_is_not_split_into_characters():
    """'ps': 'h:1' (a string, not a list) is reported as such, not as a bad entry 'h'."""
    with pytest.raises(ClusterConfigError, match="list of 'host:port' strings"):
        Cluster.from_dict({"ps": "h:1"})


def test_two_chiefs():
    with pytest.raises(ClusterConfigError, match="at most one chief"):
        Cluster.from_dict({"ps": ["a:1"], "chief": ["b:1", "c:1"]})


@pytest.mark.parametrize("spec", [{"worker": ["a:1"]}, {"ps": [], "worker": ["a:1"]}, {}])
def test_no_ps(spec):
    with pytest.raises(ClusterConfigError, match="no 'ps' tasks"):
        Cluster.from_dict(spec)


def test_chief_task():
    """The chief task, else worker 0, else None."""
    assert Cluster.from_dict(SPEC).chief_task == TaskSpec("chief", 0)
    assert Cluster.from_dict({"ps": ["a:1"], "worker": ["b:1", "c:1"]}).chief_task == TaskSpec("worker", 0)
    assert Cluster.from_dict({"ps": ["a:1"]}).chief_task is None


def test_tasks_lists_everything_in_order():
    cluster = Cluster.from_dict(SPEC)
    assert [(str(t), a) for t, a in cluster.tasks()] == [
        ("chief:0", "h0:2222"), ("worker:0", "h1:2222"), ("worker:1", "h2:2222"),
        ("ps:0", "h3:2222"), ("ps:1", "h4:2223")]


@pytest.mark.parametrize("task", [TaskSpec("chief", 0), TaskSpec("worker", 1), TaskSpec("ps", 1)])
def test_tf_config_round_trips(task):
    """tf_config(task) parses back to the same cluster and task."""
    cluster = Cluster.from_dict(SPEC)
    text = cluster.tf_config(task)
    assert json.loads(text)["cluster"] == SPEC
    assert Cluster.from_tf_config({"TF_CONFIG": text}) == (cluster, task)


def test_tf_config_rejects_a_task_not_in_the_cluster():
    with pytest.raises(ClusterConfigError, match="not in the cluster"):
        Cluster.from_dict(SPEC).tf_config(TaskSpec("worker", 5))


def test_to_dict_leaves_out_empty_types():
    assert Cluster(ps=("a:1",)).to_dict() == {"ps": ["a:1"]}
