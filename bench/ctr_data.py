"""bench/ctr.py's data: the Criteo Kaggle layout, a synthetic click stream of that shape made here (seeded, no
download), and a reader for real Criteo TSV files; either becomes days saved as .npy files in a folder.

A sample is a label, 13 dense features and one id per categorical field (26).
Field t's ids lie in [0, id_spaces[t]): its Criteo cardinality, or
--cardinality-cap where that is smaller (the tables' hash size; DLRM's
--max-ind-range, TorchRec's num_embeddings_per_feature).

The synthetic stream is examples/dlrm.py's hidden click model drifting from
day to day as bench/freshness.py's (DriftingClicks, with days for its hours):
field t's ids drawn Zipf(alpha) over its id space; dense features N(0, 1); the
model's weights scaled so that its own AUC is near what the best models reach
on Criteo, and its bias fitted so that day 1's click rate is Criteo's. Each
day's true click probabilities are kept, so the ground truth's AUC on the
held-out day is known.

Real files: Criteo's TSV layout, one sample a line: label, 13 integers, 26
categorical values as 8 hex digits, tab-separated, any field but the label
possibly empty. As DLRM's data_utils.py reads them: an empty field is 0, the
integers below 0 become 0 and then log(x + 1), a category is its hex value
modulo the field's id space.
"""

from __future__ import annotations

import itertools
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import dlrm  # noqa: E402 - examples/dlrm.py: the hidden click model
from freshness import DriftingClicks  # noqa: E402 - the drift from one draw of the click model to another

# Distinct values per categorical field of Criteo's Kaggle train.txt, as facebookresearch/dlrm counts them for
# --data-set=kaggle (tools/visualize.py's ln_emb, commit 090956e; data_utils.py computes them).
CRITEO_KAGGLE_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                               14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
DENSE = dlrm.DENSE_FEATURES  # 13, as Criteo's
FIELDS = 1 + DENSE + len(CRITEO_KAGGLE_CARDINALITIES)  # a TSV line's fields: label, integers, categories
# dlrm.ClickModel's weights scaled for 26 fields rather than its 8: the hidden model's own AUC near the 0.80 the
# best Kaggle models reach, with the categories carrying most of it.
DENSE_SCALE, EFFECT_SCALE, LATENT_SCALE = 0.5, 0.4, 0.4
CLICK_RATE = 0.256          # the share of clicks in Criteo's Kaggle train.txt: the stream's bias is set to match
CALIBRATION_SAMPLES = 20_000  # day 1's samples the bias is fitted on
ARRAYS = ("dense", "ids", "clicks")


def id_spaces(cap: int) -> list[int]:
    """Each field's id space: its Criteo Kaggle cardinality, at most `cap` (0: no cap, the full layout)."""
    return [min(n, cap) if cap else n for n in CRITEO_KAGGLE_CARDINALITIES]


class CriteoStream:
    """The synthetic stream: day d's click model (dlrm.ClickModel, scaled) for the id spaces `spaces`; its
    effects turn into an independent draw's over `drift_days` days (math.inf: stationary) and `churn` of each
    field's ids change popularity rank a day."""

    def __init__(self, spaces: list[int], alpha: float, seed: int, drift_days: float, churn: float):
        self.drifting = DriftingClicks(spaces, alpha, seed, drift_days, churn)
        self.seed, self.bias = seed, 0.0
        *_, truth = self.model(0).sample(np.random.default_rng([seed, 9]), CALIBRATION_SAMPLES, 1)
        truth = np.clip(truth, 1e-12, 1 - 1e-12)
        logits = np.log(truth) - np.log1p(-truth)
        low, high = -20.0, 20.0  # the bias whose mean click probability on day 1 is CLICK_RATE, by bisection
        for _ in range(50):
            self.bias = (low + high) / 2
            low, high = (self.bias, high) if np.mean(1 / (1 + np.exp(-logits - self.bias))) < CLICK_RATE else (
                low, self.bias)

    def model(self, d: int) -> dlrm.ClickModel:
        """Day d's click model."""
        model = self.drifting.at(d)
        model.dense_weights = DENSE_SCALE * model.dense_weights
        model.effects = [EFFECT_SCALE * e for e in model.effects]
        model.latents = [LATENT_SCALE * v for v in model.latents]
        model.bias = self.bias
        return model

    def day(self, d: int, n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Day d's n samples (ARRAYS) and their true click probabilities."""
        dense, ids, clicks, truth = self.model(d).sample(np.random.default_rng([self.seed, 10, d]), n, 1)
        return {"dense": dense.numpy(), "ids": ids[:, :, 0].numpy(), "clicks": clicks.numpy()}, truth


def read_tsv(path: pathlib.Path, spaces: list[int], start: int = 0, count: int | None = None) -> dict[str, np.ndarray]:
    """Lines start .. start + count - 1 (count None: to the end) of a Criteo TSV file as ARRAYS (see the module
    docstring). ValueError naming the line if one is not of the layout."""
    labels, ints, cats = [], [], []
    with open(path, encoding="ascii", errors="replace") as f:
        stop = None if count is None else start + count
        for number, line in enumerate(itertools.islice(f, start, stop), start + 1):
            fields = line.rstrip("\r\n").split("\t")
            try:
                if len(fields) != FIELDS:
                    raise ValueError(f"{len(fields)} fields where the Criteo layout has {FIELDS} (label, "
                                     f"{DENSE} integers, {len(spaces)} categories)")
                labels.append(int(fields[0]))
                ints.append([int(x) if x else 0 for x in fields[1:1 + DENSE]])
                cats.append([int(x, 16) if x else 0 for x in fields[1 + DENSE:]])
            except ValueError as exc:
                raise ValueError(f"{path}, line {number}: {exc}") from None
    dense = np.log(np.maximum(np.array(ints, dtype=np.float64).reshape(-1, DENSE), 0.0) + 1.0)
    ids = np.array(cats, dtype=np.int64).reshape(-1, len(spaces)) % np.array(spaces, dtype=np.int64)
    return {"dense": dense.astype(np.float32), "ids": ids, "clicks": np.array(labels, dtype=np.float32)}


def count_lines(path: pathlib.Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))


def tsv_days(paths: list[pathlib.Path], days: int) -> list[tuple[pathlib.Path, int, int]]:
    """(file, first line, lines) of each day, the held-out one last: one file a day (Criteo Terabyte's), or one
    file cut into days + 1 consecutive equal parts (as DLRM cuts Kaggle's train.txt into its 7 days)."""
    if len(paths) > 1:
        return [(p, 0, count_lines(p)) for p in paths]
    lines = count_lines(paths[0])
    per_day = lines // (days + 1)
    if per_day < 1:
        raise ValueError(f"{paths[0]} has {lines} lines: too few for {days} days and a held-out one")
    return [(paths[0], d * per_day, per_day) for d in range(days + 1)]


def save_day(folder: pathlib.Path, d: int, arrays: dict[str, np.ndarray]) -> int:
    """Writes day d's arrays into `folder`; returns its samples."""
    for name in ARRAYS:
        np.save(folder / f"day{d}_{name}.npy", arrays[name])
    return len(arrays["clicks"])


def load_share(folder: pathlib.Path, d: int, index: int, of: int) -> dict[str, np.ndarray]:
    """Worker `index`'s share of day d among `of` workers: samples index, index + of, ... in time order, each
    worker as many (the day's last few may be left out), so that a sync job's workers take equal steps."""
    arrays = {name: np.load(folder / f"day{d}_{name}.npy", mmap_mode="r") for name in ARRAYS}
    share = len(arrays["clicks"]) // of
    return {name: np.ascontiguousarray(a[index::of][:share]) for name, a in arrays.items()}


def load_day(folder: pathlib.Path, d: int) -> dict[str, np.ndarray]:
    return {name: np.load(folder / f"day{d}_{name}.npy") for name in ARRAYS}


def make_days(args, folder: pathlib.Path) -> dict:
    """Writes the training days 0, 1, ... and then the held-out day into `folder`, from args.criteo_tsv's files
    or else the synthetic stream (args.days training days); returns what the results record of the data, its
    `training_days` included."""
    spaces = id_spaces(args.cardinality_cap)
    sizes, held_truth = [], None
    if args.criteo_tsv:
        for d, (path, first, lines) in enumerate(tsv_days(args.criteo_tsv, args.days)):
            sizes.append(save_day(folder, d, read_tsv(path, spaces, first, min(lines, args.samples_per_day))))
        source = {"source": "criteo_tsv", "files": [str(p) for p in args.criteo_tsv]}
    else:
        stream = CriteoStream(spaces, args.alpha, args.seed, args.drift_days, args.churn)
        for d in range(args.days + 1):
            arrays, held_truth = stream.day(d, args.samples_per_day)
            sizes.append(save_day(folder, d, arrays))
        source = {"source": "synthetic", "alpha": args.alpha, "drift_days": args.drift_days, "churn": args.churn}
    held = load_day(folder, len(sizes) - 1)
    out = {**source, "training_days": len(sizes) - 1, "id_spaces": spaces, "rows_in_id_spaces": sum(spaces),
           "samples_per_day": sizes, "held_out_click_rate": float(held["clicks"].mean())}
    if held_truth is not None:
        out["oracle_auc"] = dlrm.auc(held_truth, held["clicks"])
    if min(sizes) < args.workers:
        raise ValueError(f"a day of {min(sizes)} samples cannot be shared by {args.workers} workers")
    return out

