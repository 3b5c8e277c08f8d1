#!/usr/bin/env python
"""Prints, for every task of a cluster, the environment and command that starts it on its host.

    python deploy/cluster_commands.py --ps h3:2222 h4:2222 --workers h1:2222 h2:2222 --chief h0:2222 \\
        --credentials /etc/torchps/job -- --mode sync --epochs 10 --checkpoint-dir /shared/ckpt

Run the first line (ps-certs) once per job (it refuses a folder that holds credentials already; ps-certs DIR
--rotate renews the tokens of a running job), copy the credentials folder to every host
(each host needs ca.crt, its own task's .crt, .key and .token (a shard's: tokens),
and for the chief and the shards admin-token; never ca.key), then run each task's line on the
host it names (by ssh, a scheduler, or a container entrypoint). Flags after
`--` go to every ps-worker, except --checkpoint-dir, which goes to the
ps-servers. Every process gets the same TF_CONFIG cluster and its own task,
exactly as a Kubeflow TFJob sets it. Without --credentials every task runs
--insecure (a trusted network only).
"""

import argparse
import json
import shlex
import sys

from torchps.certs import role_of
from torchps.client import Cluster, TaskSpec


def security_flags(cluster: Cluster, task: TaskSpec, credentials: str | None) -> list[str]:
    """The flags naming `task`'s files in the credentials folder (as ps-certs writes it), or --insecure."""
    if credentials is None:
        return ["--insecure"]
    stem = f"{credentials}/{task.type}-{task.index}"
    flags = ["--tls-cert", f"{stem}.crt", "--tls-key", f"{stem}.key", "--tls-ca", f"{credentials}/ca.crt",
             "--token-file", f"{credentials}/tokens" if task.type == "ps" else f"{stem}.token"]
    if role_of(cluster, task) in ("chief", "ps"):
        flags += ["--admin-token-file", f"{credentials}/admin-token"]
    return flags


def commands(cluster: Cluster, worker_args: list[str], credentials: str | None = None) -> list[tuple[str, str]]:
    """(host, shell line) for every task (after the ps-certs line, with credentials)."""
    ps_args, rest = [], list(worker_args)
    if "--checkpoint-dir" in rest:
        at = rest.index("--checkpoint-dir")
        ps_args, rest = rest[at:at + 2], rest[:at] + rest[at + 2:]
    lines = []
    if credentials is not None:
        lines.append(("any host", shlex.join(["ps-certs", credentials, "--cluster", json.dumps(cluster.to_dict())])))
    for task, address in cluster.tasks():
        program = ["ps-server", *ps_args] if task.type == "ps" else ["ps-worker", *rest]
        program += security_flags(cluster, task, credentials)
        env = f"TF_CONFIG={shlex.quote(cluster.tf_config(TaskSpec(task.type, task.index)))}"
        lines.append((address.rpartition(":")[0], f"{env} {shlex.join(program)}"))
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, worker_args = argv, []
    if "--" in argv:
        at = argv.index("--")
        ours, worker_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ps", nargs="+", required=True, metavar="HOST:PORT")
    parser.add_argument("--workers", nargs="*", default=[], metavar="HOST:PORT")
    parser.add_argument("--chief", metavar="HOST:PORT")
    parser.add_argument("--evaluator", metavar="HOST:PORT")
    parser.add_argument("--credentials", metavar="DIR", help="the folder ps-certs writes, as every host sees it")
    args = parser.parse_args(ours)
    cluster = Cluster(ps=args.ps, worker=args.workers, chief=[args.chief] if args.chief else [],
                      evaluator=[args.evaluator] if args.evaluator else [])
    for host, line in commands(cluster, worker_args, args.credentials):
        print(f"# on {host}\n{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
