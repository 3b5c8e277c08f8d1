"""Asynchronous data-parallel training with a custom loop: pull, forward/backward, push.

The torchps version of the classic distributed TensorFlow example (a 784-100-10
sigmoid MLP trained with SGD, batch 100). It starts `--ps` ps-server processes
on 127.0.0.1, then `--workers` worker processes. Each worker has its own
PSClient and trains on its own shard of the training set; the shards apply
every pushed gradient at once with the server-side SGD (no waiting between
workers). Worker 0 is the chief: it creates the variables, prints progress,
waits for the others' last pushes, then pulls the final parameters and tests
them on the full test set.

The job is secured the way ps-launch secures one: a CA, a certificate per task
and the job and admin tokens made for it in a private temporary folder, gone
at the end; every shard requires them (mutual TLS + token) and every PSClient
presents its task's (`--insecure` runs in plaintext instead).

    python examples/custom_loop.py                        # Fashion-MNIST if installed, else mnist5k
    python examples/custom_loop.py --dataset mnist5k --epochs 2 --workers 3 --ps 1
    python examples/custom_loop.py --device cuda          # each worker's model on the GPU
"""

import argparse
import math
import multiprocessing
import multiprocessing.connection
import pathlib
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from torchps.certs import TaskCredentials, issue_job_credentials
from torchps.client import Cluster, Optimizer, PSClient, TaskSpec
from torchps.security import INSECURE
from torchps.worker.data import DatasetNotFoundError, batches, default_dataset_name, load_dataset, shard_indices
from torchps.worker.local_cluster import LocalCluster

LOG_EVERY = 100  # chief steps between progress lines


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(784, hidden), torch.nn.Sigmoid(), torch.nn.Linear(hidden, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    device = next(model.parameters()).device
    with torch.no_grad():
        return (model(x.to(device)).argmax(dim=1).cpu() == y).float().mean().item()


def steps_per_worker(n: int, args: argparse.Namespace) -> list[int]:
    """How many pushes each worker makes: its shard's batches times the epochs."""
    return [args.epochs * math.ceil(len(shard_indices(n, args.workers, i)) / args.batch_size)
            for i in range(args.workers)]


def train(index: int, cluster: Cluster, args: argparse.Namespace, files: TaskCredentials | None) -> None:
    """One worker process: task ('worker', index) of `cluster`, with its credentials; worker 0 is the chief."""
    torch.set_num_threads(1)  # ps shards and workers share the machine's cores
    torch.manual_seed(args.seed)  # initial values; only the chief's are used
    data = load_dataset(args.dataset)
    mine = shard_indices(len(data.y_train), args.workers, index)
    x, y = data.x_train[mine], data.y_train[mine]
    model = make_model(args.hidden).to(args.device)  # on a GPU, pulls and pushes go through pinned buffers
    with PSClient(cluster, task=TaskSpec("worker", index), security=files.security() if files else INSECURE) as ps:
        # The chief creates the variables; the others wait for them. Either way the model ends up pulled.
        binding = ps.register_module(model, Optimizer("sgd", lr=args.lr))
        start = last_time = time.monotonic()
        last_step, losses = binding.step, []
        for epoch in range(args.epochs):
            for xb, yb in batches(x, y, args.batch_size, seed=args.seed + index, epoch=epoch):
                binding.pull()  # the latest shared parameters
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xb.to(args.device)), yb.to(args.device))
                loss.backward()
                step = binding.push()  # the shards apply SGD; returns the global step after it
                losses.append(loss.item())
                if ps.is_chief and len(losses) == LOG_EVERY:
                    now = time.monotonic()
                    print(f"epoch {epoch + 1}/{args.epochs}  step {step:6d}  loss {sum(losses) / len(losses):.4f}  "
                          f"{(step - last_step) / (now - last_time):6.1f} steps/s", flush=True)
                    last_step, last_time, losses = step, now, []
            if ps.is_chief:
                print(f"epoch {epoch + 1} done: test accuracy {accuracy(model, data.x_test, data.y_test):.4f} "
                      "(chief's latest pull)", flush=True)
        if not ps.is_chief:
            print(f"worker {index} done: {len(y)} examples x {args.epochs} epochs", flush=True)
            return
        total = sum(steps_per_worker(len(data.y_train), args))
        while ps.global_step() < total:  # the other workers' last pushes
            time.sleep(0.05)
        binding.pull()
        elapsed = time.monotonic() - start
        final = accuracy(model, data.x_test, data.y_test)
        print(f"final test accuracy: {final:.4f}", flush=True)
        print(f"summary: dataset={data.name} device={args.device} workers={args.workers} ps={args.ps} "
              f"epochs={args.epochs} batch={args.batch_size} lr={args.lr} global_steps={ps.global_step()} "
              f"train_seconds={elapsed:.1f} steps_per_s={total / elapsed:.1f} test_accuracy={final:.4f}", flush=True)


def run_workers(cluster: Cluster, args: argparse.Namespace, credentials: dict | None) -> int:
    """Starts every worker process; stops the rest as soon as one fails. Returns 0 if all succeeded."""
    context = multiprocessing.get_context("forkserver")  # each worker forked from a server that imported
    context.set_forkserver_preload(["__main__"])         # this script (torch, torchps) once
    procs = [context.Process(target=train, name=f"worker-{i}", args=(
        i, cluster, args, credentials[TaskSpec("worker", i)] if credentials else None)) for i in range(args.workers)]
    for proc in procs:
        proc.start()
    try:
        running = list(procs)
        while running:
            for sentinel in multiprocessing.connection.wait([p.sentinel for p in running]):
                proc = next(p for p in running if p.sentinel == sentinel)
                proc.join()
                running.remove(proc)
                if proc.exitcode != 0:
                    print(f"error: {proc.name} exited with code {proc.exitcode}; stopping the others", file=sys.stderr)
                    return 1
        return 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default=default_dataset_name(),
                        help="fashion-mnist, mnist5k or a folder of MNIST idx files (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.5, help="server-side SGD learning rate")
    parser.add_argument("--hidden", type=int, default=100, help="hidden sigmoid units")
    parser.add_argument("--workers", type=int, default=2, help="worker processes; worker 0 is the chief")
    parser.add_argument("--ps", type=int, default=2, help="ps-server processes (shards)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--insecure", action="store_true", help="plaintext shards, no certificates or tokens")
    parser.add_argument("--device", default="cpu", help="where each worker's model lives: cpu, cuda or cuda:N "
                        "(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.ps < 1 or args.epochs < 1 or args.batch_size < 1:
        parser.error("--workers, --ps, --epochs and --batch-size must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this host")
    try:
        data = load_dataset(args.dataset)
    except DatasetNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    steps = steps_per_worker(len(data.y_train), args)
    print(f"dataset {data}; {args.workers} workers x {steps[0]} steps, {args.ps} ps", flush=True)
    del data  # each worker loads its own copy
    with tempfile.TemporaryDirectory(prefix="custom-loop-") as private:  # mode 0700, removed at the end
        credentials, shard_flags = None, []
        if not args.insecure:  # the tasks as they will be (addresses matter only as 127.0.0.1 in certificates)
            tasks = Cluster(ps=tuple(f"127.0.0.1:{1 + i}" for i in range(args.ps)),
                            worker=tuple(f"127.0.0.1:{1 + args.ps + i}" for i in range(args.workers)))
            issued = issue_job_credentials(tasks, days=1)  # in memory; the CA's key is not kept
            credentials = {task: issued.write_task(task, pathlib.Path(private) / f"{task.type}-{task.index}")
                           for task, _ in tasks.tasks()}  # each process gets only its own files
            # every shard serves with ps:0's certificate: LocalCluster gives all shards the same flags
            shard_flags = credentials[TaskSpec("ps", 0)].flags()
        with LocalCluster(num_ps=args.ps, workers=args.workers, server_args=shard_flags) as local:
            print(f"ps shards on {', '.join(local.cluster.ps)} "
                  f"({'plaintext, INSECURE' if args.insecure else 'mutual TLS + per-task tokens'})", flush=True)
            return run_workers(local.cluster, args, credentials)


if __name__ == "__main__":
    sys.exit(main())
