"""deploy/grafana/torchps.json, the Grafana dashboard: a well-formed dashboard Grafana 10/11 imports (a data
source variable, no data source of ours hard-coded, unique panels with queries), and every panel's PromQL,
its template variables filled in, answers with data from a real Prometheus scraping a small sync job: two
shards, two workers and an evaluator (the workers' and the evaluator's metrics served in this process by
ps-worker's own classes, trained by its training loop)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import re
import threading
import time

import pytest
import torch

from helpers import needs_prometheus, prometheus, prometheus_api, prometheus_query, wait_until
from torchps.client import ModuleBinding, Optimizer, PSClient, TaskSpec, UnknownVariableError
from torchps.cluster import Cluster
from torchps.metrics_http import serve_metrics
from torchps.worker.data import Dataset
from torchps.worker.local_cluster import LocalCluster
from torchps.worker.models import Task
from torchps.worker.observe import EvaluatorMetrics, StepObserver, WorkerMetrics
from torchps.worker.trainer import TrainOptions, evaluate_once, train

DASHBOARD = pathlib.Path(__file__).parents[2] / "deploy" / "grafana" / "torchps.json"
RATE_INTERVAL = "1m"  # Grafana's $__rate_interval, here a window that spans the whole job (well under a minute)
CHUNK = 15  # global steps per training round; Prometheus scrapes between rounds, so its counters move


def panels(dashboard: dict) -> list[dict]:
    """Every panel but the rows, including those inside collapsed rows."""
    found = []
    for panel in dashboard["panels"]:
        found.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return found


def filled(expr: str, values: dict[str, list[str]]) -> str:
    """`expr` with the variables put in as Grafana does for a multi-value variable: (a|b), each value's regex
    characters escaped (twice: once for the regex, once for PromQL's string)."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name in sorted(values, key=len, reverse=True):
        escaped = (re.escape(value).replace("\\", "\\\\") for value in values[name])
        expr = expr.replace(f"${name}", "(" + "|".join(escaped) + ")")
    return expr


def offered(port: int, dashboard: dict) -> dict[str, list[str]]:
    """What each query variable offers (label_values, asked of Prometheus as Grafana asks it), each depending
    on the ones before it with all of theirs selected ("All")."""
    values: dict[str, list[str]] = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            selector, label = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["query"]).groups()
            values[variable["name"]] = prometheus_api(port, f"label/{label}/values",
                                                      **{"match[]": filled(selector, values)})
    return values


def datasources(node) -> list:
    """Every value of a "datasource" key anywhere in the document."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "datasource"] + [d for v in node.values() for d in datasources(v)]
    if isinstance(node, list):
        return [d for v in node for d in datasources(v)]
    return []


def test_the_dashboard_is_importable_with_unique_panels_and_no_fixed_datasource():
    """Valid JSON of Grafana's dashboard model: a `datasource` variable every panel, target and variable
    query uses (no data source uid of an installation written in), every panel a timeseries or stat with a
    unique id and title and at least one PromQL target, and every variable used defined (and the reverse)."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "shard", "worker"} <= set(variables)
    found = panels(dashboard)
    assert len(found) >= 30
    for key in ("id", "title"):
        values = [p[key] for p in [*found, *(p for p in dashboard["panels"] if p["type"] == "row")]]
        assert len(values) == len(set(values)), f"panel {key}s repeat: {sorted(values)}"
    for panel in found:
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
    for source in datasources(dashboard):
        if source.get("type") == "grafana":  # the built-in annotations' own source
            continue
        assert source == {"type": "prometheus", "uid": "${datasource}"}, source
    used = {name for p in found for t in p["targets"] for name in re.findall(r"\$(\w+)", t["expr"])}
    assert used - {"__rate_interval"} == set(variables) - {"datasource"}, "variables used and defined differ"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            # No allValue: "All" is the variable's own values, not ".*", which would match every target of the
            # job in the panels on process_* metrics (a shard's memory among the workers').
            assert variable["multi"] and variable["includeAll"] and "allValue" not in variable, variable["name"]


def _overlaps(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def test_the_dashboards_panels_do_not_overlap():
    """Grafana would move overlapping panels on import: the layout in the file is the one shown."""
    grids = [(p["title"], p["gridPos"]) for p in json.loads(DASHBOARD.read_text())["panels"]]
    clashes = [(a, b) for i, (a, ga) in enumerate(grids) for b, gb in grids[i + 1:] if _overlaps(ga, gb)]
    assert not clashes, clashes


def _dataset(examples: int = 200) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(examples, 10, generator=generator)
    y = torch.randint(0, 3, (examples,), generator=generator)
    return Dataset("random", x, y, x[:50], y[:50])


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


@dataclasses.dataclass
class Job:
    """A sync job (R = N = 2): each worker's client, task, binding and observer (its metrics), and the
    evaluator's client, task, binding and metrics."""

    workers: list[tuple[PSClient, Task, ModuleBinding, StepObserver]]
    evaluator: tuple[PSClient, Task, ModuleBinding, EvaluatorMetrics]

    def train_to(self, step: int) -> None:
        """Both workers train (ps-worker's loop) until the global step reaches `step`; blocks."""
        errors: list[BaseException] = []

        def run(replica: int) -> None:
            client, task, binding, observer = self.workers[replica]
            try:
                train(client, task, binding, replica=replica, num_replicas=len(self.workers), observer=observer,
                      options=TrainOptions(epochs=None, steps=step, batch_size=10, log_every=1e9, progress=False))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.workers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors and not any(t.is_alive() for t in threads), errors

    def evaluate(self) -> None:
        """One evaluation (the evaluator's own), its figures in its metrics."""
        client, task, binding, metrics = self.evaluator
        evaluate_once(client, task, binding, "cpu", metrics.evaluated)


def _scraped_since(port: int, moment: float, targets: int) -> bool:
    """True once Prometheus scraped each of its `targets` targets, up, at or after `moment` (wall clock)."""
    latest = prometheus_query(port, "timestamp(up)")  # of a plain selector: the scrapes' own times
    up = prometheus_query(port, "up == 1")
    return len(latest) == len(up) == targets and min(float(r["value"][1]) for r in latest) >= moment


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """The port of a Prometheus that scraped the job before, between and after two rounds of training, with a
    checkpoint saved and a failed call made between them: each counter has moved between two scrapes."""
    folder = tmp_path_factory.mktemp("grafana")
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(LocalCluster(2, workers=2, server_args=[
            "--metrics-port", "0", "--checkpoint-dir", str(folder / "checkpoints")]))
        cluster = Cluster.from_dict({**local.cluster.to_dict(), "evaluator": ["127.0.0.1:3"]})
        clients = [stack.enter_context(PSClient(cluster, task=TaskSpec("worker", i), connect_timeout=30))
                   for i in range(2)]
        reader = stack.enter_context(PSClient(cluster, task=TaskSpec("evaluator", 0), connect_timeout=30))
        clients[0].configure("sync", total_num_replicas=2, replicas_to_aggregate=2)
        tasks = [Task(_model(), _dataset()) for _ in range(3)]
        metrics = [WorkerMetrics(), WorkerMetrics(), EvaluatorMetrics()]
        job = Job([(clients[i], tasks[i], clients[i].register_module(tasks[i].model, Optimizer("sgd", lr=0.1),
                                                                     create=i == 0, wait_timeout=60),
                    StepObserver(metrics[i])) for i in range(2)],
                  (reader, tasks[2], reader.register_module(tasks[2].model, create=False, join=False), metrics[2]))
        targets = [f"127.0.0.1:{clients[0].status(i).metrics_port}" for i in range(2)]
        targets += [f"127.0.0.1:{serve_metrics(m.registry, '127.0.0.1', 0)}" for m in metrics]
        web = stack.enter_context(prometheus(targets, folder))

        def scrape_after(moment: float, what: str) -> None:
            wait_until(lambda: _scraped_since(web, moment, len(targets)), 60, what, interval=0.2)

        scrape_after(time.time(), "a first scrape of every target")
        job.train_to(CHUNK)
        scrape_after(time.time(), "a scrape after the first round")
        job.evaluate()
        clients[0].save_checkpoint(0)  # the state now: the job is idle between rounds
        clients[0].declare({"never/created": torch.zeros(1)})
        with pytest.raises(UnknownVariableError):  # a failed call (NOT_FOUND) for the errors panel
            clients[0].pull(["never/created"])
        job.train_to(2 * CHUNK)
        job.evaluate()
        scrape_after(time.time() + 1, "two scrapes after the second round")  # 1 s: the scrape interval
        yield web


@needs_prometheus
def test_every_panel_of_the_dashboard_shows_data(scraped):
    """The variables offer the job, its two shards and its three workers (the evaluator too), and with all of
    them selected each target's query returns at least one series with a number (not NaN): no panel is empty."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = offered(scraped, dashboard)
    assert (len(values["job"]), len(values["shard"]), len(values["worker"])) == (1, 2, 3), values
    empty = []
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr = filled(target["expr"], values)
            numbers = [float(r["value"][1]) for r in prometheus_query(scraped, expr)]
            if not any(math.isfinite(n) for n in numbers):
                empty.append(f"{panel['title']}: {expr} -> {numbers}")
    assert not empty, "\n".join(empty)
