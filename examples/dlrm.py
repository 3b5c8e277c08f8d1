"""A DLRM-style click-through-rate model whose embedding tables live on the parameter-server shards.

The model is DLRM's (Naumov et al., 2019): dense features through a bottom
MLP, one categorical feature per table through an EmbeddingBag, the pairwise
dot products of all those vectors (DLRM's "dot" interaction), then a top MLP
to one logit, trained with binary cross-entropy. The tables are
torchps.client.EmbeddingBag: their rows are spread over the shards and only a
batch's distinct rows travel (looked up in forward, their gradients pushed
with the dense ones and applied by a server-side Adagrad); the dense layers
are trained by a server-side Adam.

No click log can be downloaded here, so the data is DLRM's own kind of
synthetic data (its --data-generation=random, made learnable): 13 dense
features N(0, 1), and per table ids drawn Zipf(alpha) over its cardinality
(a few hot ids, a long tail), mapped through a fixed random permutation.
Clicks come from a hidden ground-truth model: a logistic function of a
linear term in the dense features, a per-id effect for every table,
dot products of per-id latent vectors for some pairs of tables, and a
dense x categorical term. Training and held-out samples are independent
draws; held-out AUC is computed here (rank-based, ties averaged), beside the
ground truth's own AUC on the same samples (the best any model can do).

It starts `--ps` ps-server processes on 127.0.0.1 (mutual TLS + per-task tokens,
as ps-launch secures a job; `--insecure` for plaintext), or uses the shards of
`--cluster JSON` (security from the TORCHPS_* variables), then `--workers`
asynchronous worker processes, each with its own PSClient and its own share
of the training samples. Worker 0 is the chief: it creates the tables and
variables, prints progress, waits for the others' last pushes and evaluates.

    python examples/dlrm.py                                   # about a minute on 2 cores
    python examples/dlrm.py --train-samples 40000 --test-samples 10000 --insecure
    python examples/dlrm.py --cardinalities 1000000,100000,10000 --dim 32 --epochs 2
"""

import argparse
import math
import multiprocessing
import multiprocessing.connection
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from torchps.certs import TaskCredentials, issue_job_credentials
from torchps.client import Cluster, ClusterConfigError, EmbeddingBag, Optimizer, PSClient, TaskSpec, prefetch_rows
from torchps.security import INSECURE
from torchps.worker.local_cluster import LocalCluster

DENSE_FEATURES = 13  # as Criteo's click logs, which DLRM was built for
CARDINALITIES = "200000,100000,50000,20000,10000,5000,1000,100"
LATENT = 4           # width of the ground truth's per-id latent vectors
PAIRS = ((0, 1), (2, 3), (4, 5), (0, 6), (1, 7))  # tables whose ids interact in the ground truth
LOG_EVERY = 100      # chief steps between progress lines


# -- data -----------------------------------------------------------------------------------------

class ClickModel:
    """The hidden ground truth, the same in every process for a seed: how ids are drawn and who clicks."""

    def __init__(self, cardinalities: list[int], alpha: float, seed: int):
        rng = np.random.default_rng([seed, 1])
        self.cardinalities = cardinalities
        self.cdfs = []
        for n in cardinalities:
            cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -alpha)
            self.cdfs.append(cdf / cdf[-1])
        self.permutations = [rng.permutation(n) for n in cardinalities]  # rank -> id: hot ids are anywhere
        self.dense_weights = rng.normal(0.0, 1.0 / math.sqrt(DENSE_FEATURES), DENSE_FEATURES)
        self.effects = [rng.normal(0.0, 0.6, n) for n in cardinalities]
        self.latents = [rng.normal(0.0, 0.6, (n, LATENT)) for n in cardinalities]
        self.pairs = [(a, b) for a, b in PAIRS if b < len(cardinalities)]
        self.bias = -1.2

    def sample(self, rng: np.random.Generator, n: int, per_table: int):
        """n samples: dense (n, 13) float32, ids (n, tables, per_table) int64, clicks (n,) float32, and the
        true click probabilities (n,)."""
        dense = rng.standard_normal((n, DENSE_FEATURES))
        ids = np.stack([perm[np.minimum(np.searchsorted(cdf, rng.random((n, per_table))), len(cdf) - 1)]
                        for cdf, perm in zip(self.cdfs, self.permutations)], axis=1)
        effect = [self.effects[t][ids[:, t]].mean(axis=1) for t in range(ids.shape[1])]
        latent = [self.latents[t][ids[:, t]].mean(axis=1) for t in range(ids.shape[1])]
        logit = self.bias + dense @ self.dense_weights + sum(effect)
        logit += sum((latent[a] * latent[b]).sum(axis=1) for a, b in self.pairs)
        if len(latent) > 1:
            logit += 0.5 * dense[:, 0] * latent[1][:, 0]
        probability = 1.0 / (1.0 + np.exp(-logit))
        clicks = (rng.random(n) < probability).astype(np.float32)
        return (torch.from_numpy(dense.astype(np.float32)), torch.from_numpy(ids), torch.from_numpy(clicks),
                probability)


def auc(scores, labels) -> float:
    """Area under the ROC curve: the probability that a random positive scores above a random negative
    (Mann-Whitney U from ranks, tied scores sharing their average rank)."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels) > 0.5
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # 1-based, ties averaged
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


# -- the model ------------------------------------------------------------------------------------

def mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    """Linear layers from widths[0] to widths[-1], a ReLU after each but (without last_relu) the last."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if last_relu or i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, EmbeddingBags on the shards, pairwise dot interactions, top MLP -> one logit.

    `bottom` and `top`: the MLPs' hidden widths (DLRM's Criteo Kaggle model: (512, 256, 64) and (512, 256)); a
    table of cardinality None is dynamic (any int64 id, rows made as ids are trained on)."""

    def __init__(self, cardinalities: list[int | None], dim: int, table_lr: float, bottom=(64,), top=(64,)):
        super().__init__()
        self.bottom = mlp([DENSE_FEATURES, *bottom, dim], last_relu=True)
        self.tables = nn.ModuleList([
            EmbeddingBag(n, dim, mode="sum", optimizer=Optimizer("adagrad", lr=table_lr), init_scale=0.05)
            for n in cardinalities])
        vectors = len(cardinalities) + 1
        self.register_buffer("pairs", torch.triu_indices(vectors, vectors, offset=1), persistent=False)
        self.top = mlp([dim + self.pairs.shape[1], *top, 1], last_relu=False)

    def prefetch(self, ids: torch.Tensor, upcoming: torch.Tensor | None = None) -> None:
        """Reads every table's rows for `ids` in one call per shard (forward would make one per table);
        `upcoming`: the next batch's ids, announced to shards that keep tables on SSD (prefetch_rows)."""
        prefetch_rows({table: ids[:, t] for t, table in enumerate(self.tables)},
                      None if upcoming is None else {table: upcoming[:, t] for t, table in enumerate(self.tables)})

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        z = self.bottom(dense)
        vectors = torch.stack([z] + [table(ids[:, t]) for t, table in enumerate(self.tables)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([z, dots], dim=1)).squeeze(1)


def evaluate(model: DLRM, dense, ids, clicks, batch_size: int = 4096) -> tuple[float, float]:
    """(AUC, log loss) of the model on the samples; the tables are read without admitting anything."""
    model.eval()
    logits = []
    with torch.no_grad():
        for i in range(0, len(clicks), batch_size):
            model.prefetch(ids[i:i + batch_size])
            logits.append(model(dense[i:i + batch_size], ids[i:i + batch_size]))
    logits = torch.cat(logits)
    model.train()
    return auc(logits.numpy(), clicks.numpy()), F.binary_cross_entropy_with_logits(logits, clicks).item()


# -- the workers ----------------------------------------------------------------------------------

def samples_per_worker(args: argparse.Namespace) -> list[int]:
    return [args.train_samples // args.workers + (i < args.train_samples % args.workers) for i in range(args.workers)]


def steps_per_worker(args: argparse.Namespace) -> list[int]:
    return [args.epochs * math.ceil(n / args.batch_size) for n in samples_per_worker(args)]


def train(index: int, cluster: Cluster, args: argparse.Namespace, files: TaskCredentials | None) -> None:
    """One worker process: task ('worker', index) of `cluster`; worker 0 is the chief."""
    torch.set_num_threads(1)  # shards and workers share the machine's cores
    torch.manual_seed(args.seed)  # initial dense values; only the chief's are used
    truth = ClickModel(args.cardinalities, args.alpha, args.seed)
    dense, ids, clicks, _ = truth.sample(np.random.default_rng([args.seed, 100 + index]),
                                         samples_per_worker(args)[index], args.ids_per_table)
    model = DLRM(args.cardinalities, args.dim, args.table_lr)
    security = files.security() if files else (INSECURE if args.insecure else None)  # None: TORCHPS_* variables
    with PSClient(cluster, task=TaskSpec("worker", index), security=security) as ps:
        binding = ps.register_module(model, Optimizer("adam", lr=args.lr), prefix=args.prefix)
        start = last_time = time.monotonic()
        last_step, losses = binding.step, []
        order = np.random.default_rng([args.seed, 200 + index])
        for epoch in range(args.epochs):
            perm = torch.from_numpy(order.permutation(len(clicks)))
            for i in range(0, len(clicks), args.batch_size):
                batch = perm[i:i + args.batch_size]
                model.zero_grad(set_to_none=True)
                batch_ids = ids[batch]
                model.prefetch(batch_ids)
                loss = F.binary_cross_entropy_with_logits(model(dense[batch], batch_ids), clicks[batch])
                loss.backward()
                step = binding.exchange()  # row and dense gradients pushed, dense values pulled
                losses.append(loss.item())
                if ps.is_chief and len(losses) == args.log_every:
                    now = time.monotonic()
                    rate = (step - last_step) / (now - last_time)
                    print(f"epoch {epoch + 1}/{args.epochs}  step {step:6d}  loss {sum(losses) / len(losses):.4f}  "
                          f"{rate:5.1f} steps/s  {rate * args.batch_size:7.0f} examples/s", flush=True)
                    last_step, last_time, losses = step, now, []
        if not ps.is_chief:
            print(f"worker {index} done: {len(clicks)} samples x {args.epochs} epochs", flush=True)
            return
        total = sum(steps_per_worker(args))
        while ps.global_step() < total:  # the other workers' last pushes
            time.sleep(0.05)
        binding.pull()
        elapsed = time.monotonic() - start
        test = truth.sample(np.random.default_rng([args.seed, 999]), args.test_samples, args.ids_per_table)
        held_out, held_out_loss = evaluate(model, *test[:3])
        train_auc, _ = evaluate(model, dense[:args.test_samples], ids[:args.test_samples], clicks[:args.test_samples])
        oracle = auc(test[3], test[2].numpy())
        rows = sum(t.rows for s in range(cluster.num_ps) for t in ps.status(s).tables
                   if t.name.startswith(args.prefix))
        print(f"held-out AUC: {held_out:.4f} (log loss {held_out_loss:.4f}; on training samples {train_auc:.4f}; "
              f"the ground truth's own AUC {oracle:.4f}; click rate {test[2].mean().item():.3f})", flush=True)
        print(f"summary: workers={args.workers} ps={cluster.num_ps} tables={len(args.cardinalities)} "
              f"rows={rows} dim={args.dim} train_samples={args.train_samples} test_samples={args.test_samples} "
              f"epochs={args.epochs} batch={args.batch_size} global_steps={ps.global_step()} "
              f"train_seconds={elapsed:.1f} examples_per_s={args.epochs * args.train_samples / elapsed:.0f} "
              f"heldout_auc={held_out:.4f} oracle_auc={oracle:.4f}", flush=True)


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


def given_cluster(text: str, workers: int) -> Cluster:
    """--cluster's shards, with `workers` worker tasks (its own, then placeholders: nothing serves them); its
    chief and evaluator are left out, as worker 0 is this job's chief."""
    cluster = Cluster.from_json(text)
    listed = list(cluster.worker)
    used = {address for _, address in cluster.tasks()}
    port = 1
    while len(listed) < workers:
        address = f"127.0.0.1:{port}"
        port += 1
        if address not in used:
            listed.append(address)
    return Cluster(ps=cluster.ps, worker=tuple(listed))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--cardinalities", default=CARDINALITIES,
                        help="rows of each table, comma-separated (default %(default)s)")
    parser.add_argument("--dim", type=int, default=16, help="embedding width, also the bottom MLP's output")
    parser.add_argument("--ids-per-table", type=int, default=1, help="ids per table per sample (multi-hot bags)")
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    parser.add_argument("--train-samples", type=int, default=500_000, help="training samples, split over workers")
    parser.add_argument("--test-samples", type=int, default=50_000, help="held-out samples")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3, help="server-side Adam for the dense layers")
    parser.add_argument("--table-lr", type=float, default=0.05, help="server-side Adagrad for the tables' rows")
    parser.add_argument("--workers", type=int, default=2, help="worker processes; worker 0 is the chief")
    parser.add_argument("--ps", type=int, default=2, help="ps-server processes to start (without --cluster)")
    parser.add_argument("--cluster", help="use these shards instead: cluster JSON (inline or a file) listing 'ps'")
    parser.add_argument("--prefix", default="dlrm/", help="names of the tables and variables on the shards")
    parser.add_argument("--log-every", type=int, default=LOG_EVERY, help="chief steps between progress lines")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--insecure", action="store_true", help="plaintext shards, no certificates or tokens")
    args = parser.parse_args(argv)
    try:
        args.cardinalities = [int(n) for n in args.cardinalities.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--cardinalities takes comma-separated row counts, got {args.cardinalities!r}")
    if not args.cardinalities or min(args.cardinalities) < 1:
        parser.error("--cardinalities needs at least one table of at least one row")
    for name in ("dim", "ids_per_table", "train_samples", "test_samples", "epochs", "batch_size", "workers", "ps",
                 "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.train_samples < args.workers:
        parser.error("--train-samples must be at least --workers")
    if not args.alpha > 0:
        parser.error("--alpha must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    steps = steps_per_worker(args)
    print(f"DLRM: {len(args.cardinalities)} tables ({sum(args.cardinalities):,d} rows of {args.dim}), "
          f"{args.train_samples:,d} training / {args.test_samples:,d} held-out samples, Zipf alpha {args.alpha}; "
          f"{args.workers} workers x {steps[0]} steps of {args.batch_size}", flush=True)
    if args.cluster:
        try:
            cluster = given_cluster(args.cluster, args.workers)
        except ClusterConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"ps shards on {', '.join(cluster.ps)} (given)", flush=True)
        return run_workers(cluster, args, None)
    with tempfile.TemporaryDirectory(prefix="dlrm-") as private:  # mode 0700, removed at the end
        credentials, shard_flags = None, []
        if not args.insecure:  # the tasks as they will be (addresses matter only as 127.0.0.1 in certificates)
            tasks = Cluster(ps=tuple(f"127.0.0.1:{1 + i}" for i in range(args.ps)),
                            worker=tuple(f"127.0.0.1:{1 + args.ps + i}" for i in range(args.workers)))
            issued = issue_job_credentials(tasks, days=1)  # in memory; the CA's key is not kept
            credentials = {task: issued.write_task(task, pathlib.Path(private) / f"{task.type}-{task.index}")
                           for task, _ in tasks.tasks()}  # each process gets only its own files
            shard_flags = credentials[TaskSpec("ps", 0)].flags()  # LocalCluster gives all shards the same flags
        with LocalCluster(num_ps=args.ps, workers=args.workers, server_args=shard_flags) as local:
            print(f"ps shards on {', '.join(local.cluster.ps)} "
                  f"({'plaintext, INSECURE' if args.insecure else 'mutual TLS + per-task tokens'})", flush=True)
            return run_workers(local.cluster, args, credentials)


if __name__ == "__main__":
    sys.exit(main())
