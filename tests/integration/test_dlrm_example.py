"""examples/dlrm.py end to end: a DLRM-style model with its EmbeddingBag tables on real shards, trained by
async worker processes on synthetic Zipf-distributed click data with a hidden click model, evaluated on
held-out samples by AUC. Its defaults (a secured local cluster) are the README's line, which
test_cli_readme.py runs and checks (the AUC it states, the secured shards, every worker's share)."""

import json
import pathlib
import re
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "dlrm.py"
# 40,000 training samples, batch 256: 157 pushes for one worker, 158 over two. Measured held-out AUC 0.71-0.75 over
# seeds 1-3 (the ground truth's own AUC on those samples: 0.88-0.91; a model that learned nothing: 0.5).
SMALL = ["--train-samples", "40000", "--test-samples", "10000", "--batch-size", "256", "--log-every", "40"]
MIN_AUC = 0.65


def _run(args, timeout=240):
    result = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def _summary(output: str) -> dict:
    line = re.search(r"^summary: (.*)$", output, re.MULTILINE)
    assert line, output
    return dict(field.split("=", 1) for field in line[1].split())


def test_dlrm_trains_on_a_given_cluster(local_cluster):
    local = local_cluster(2)
    cluster = json.dumps({"ps": list(local.cluster.ps)})
    output = _run([*SMALL, "--cluster", cluster, "--workers", "1", "--cardinalities", "5000,2000,100",
                   "--prefix", "given/"])
    assert f"ps shards on {', '.join(local.cluster.ps)} (given)" in output
    summary = _summary(output)
    assert summary["global_steps"] == "157" and summary["rows"] == "7100"  # 40000 / 256 rounded up; every row
    assert float(summary["heldout_auc"]) > MIN_AUC, output


def test_dlrm_reports_a_bad_cluster_in_one_line():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--cluster", '{"worker": ["h:1"]}'],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr


SERVE = EXAMPLE.parent / "serve_dlrm.py"


def test_a_serving_replica_scores_the_dlrm_model_while_it_trains_and_ends_on_the_chiefs_auc():
    """examples/serve_dlrm.py: scorings from the replica's versions while the job trains, then the final model's
    held-out AUC from the replica equal to the chief's own evaluation of it (the same rows and dense layers)."""
    result = subprocess.run([sys.executable, str(SERVE), *SMALL, "--workers", "1", "--cardinalities",
                             "5000,2000,100", "--score-every", "0.5"], capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    chief = float(re.search(r"^held-out AUC: ([0-9.]+)", output, re.MULTILINE)[1])
    final = re.search(r"^serving the final model: version \d+ \(step (\d+),.*held-out AUC ([0-9.]+)$", output,
                      re.MULTILINE)
    assert final and int(final[1]) >= 157 and abs(float(final[2]) - chief) < 1e-3, output
    assert chief > MIN_AUC and re.search(r"^serving while training: version \d+ \(step \d+", output, re.MULTILINE), \
        output
