"""Serving the DLRM example's model while it trains: a ps-serve replica follows the job, and this process scores
held-out samples with the freshest version the replica answers.

examples/dlrm.py trains (its workers, on two ps-server shards on 127.0.0.1,
plaintext); beside them one `ps-serve` replica reads the rows that change and,
every second, the dense layers. Every --score-every s this process asks the
replica for the rows of a held-out set's ids and for the dense layers, runs
DLRM's forward on them (the same arithmetic as the trained model's) and
prints the AUC of that version with its step and staleness. Once training
ends and the replica has caught up, the last line scores the final model: the
same AUC as the chief's own held-out evaluation above it.

    python examples/serve_dlrm.py                              # about a minute on 2 cores
    python examples/serve_dlrm.py --train-samples 40000 --test-samples 5000 --cardinalities 5000,1000,100
"""

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

import dlrm
from torchps.errors import UnknownVariableError
from torchps.serving import ServingClient
from torchps.worker.local_cluster import LocalCluster

DENSE_EVERY = 1.0  # s between the replica's reads of the dense layers


def served_logits(serving: ServingClient, model: dlrm.DLRM, prefix: str, dense: torch.Tensor, ids: torch.Tensor
                  ) -> tuple[torch.Tensor, int, int]:
    """(logits, version, step) of DLRM's forward on the replica's current rows and dense layers; `model` gives
    the layers' shapes and receives the dense values."""
    layers = serving.dense([f"{prefix}{name}" for name, _ in model.named_parameters()])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(layers.tensors[f"{prefix}{name}"])
        vectors = [model.bottom(dense)]
        for t in range(ids.shape[1]):
            distinct, local = torch.unique(ids[:, t], return_inverse=True)
            rows = serving.lookup(f"{prefix}tables.{t}.weight", distinct).rows
            vectors.append(F.embedding_bag(local, rows, mode="sum"))
        stacked = torch.stack(vectors, dim=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, model.pairs[0], model.pairs[1]]
        return model.top(torch.cat([vectors[0], dots], dim=1)).squeeze(1), layers.version, layers.step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--score-every", type=float, default=3.0, help="s between scorings (default 3)")
    ours, rest = parser.parse_known_args(argv)
    args = dlrm.parse_args([*rest, "--insecure"])
    torch.set_num_threads(1)
    truth = dlrm.ClickModel(args.cardinalities, args.alpha, args.seed)
    dense, ids, clicks, _ = truth.sample(np.random.default_rng([args.seed, 999]), args.test_samples,
                                        args.ids_per_table)  # the chief's held-out samples
    model = dlrm.DLRM(args.cardinalities, args.dim, args.table_lr)
    with LocalCluster(num_ps=args.ps, workers=args.workers) as local, tempfile.TemporaryDirectory() as folder:
        port_file = pathlib.Path(folder) / "port"
        replica = subprocess.Popen([sys.executable, "-m", "torchps.serving.daemon", "--cluster",
                                    json.dumps({"ps": list(local.cluster.ps)}), "--bind", "127.0.0.1:0",
                                    "--port-file", str(port_file), "--insecure", "--dense-every",
                                    str(DENSE_EVERY)])
        try:
            while not port_file.exists() or not port_file.read_text().strip():
                time.sleep(0.1)
            code = [None]
            trainer = threading.Thread(target=lambda: code.__setitem__(0, dlrm.run_workers(local.cluster, args,
                                                                                               None)))
            trainer.start()
            with ServingClient(f"127.0.0.1:{port_file.read_text().strip()}") as serving:
                def score(what: str) -> None:
                    logits, version, step = served_logits(serving, model, args.prefix, dense, ids)
                    print(f"serving {what}: version {version} (step {step}, {serving.status().staleness_seconds:.2f}"
                          f" s stale): held-out AUC {dlrm.auc(logits.numpy(), clicks.numpy()):.4f}", flush=True)

                while trainer.is_alive():
                    trainer.join(ours.score_every)
                    try:
                        if trainer.is_alive():
                            score("while training")
                    except UnknownVariableError:
                        pass  # the chief has not created the model yet, or the replica not read it yet
                if code[0] != 0:
                    return code[0]
                ended, final = time.time(), sum(dlrm.steps_per_worker(args))
                while (status := serving.status()).current.step < final or status.dense_read_unix < ended:
                    time.sleep(0.1)  # caught up: the last step's rows, and the dense layers read after it
                score("the final model")
        finally:
            replica.terminate()
            replica.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
