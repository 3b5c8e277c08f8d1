#!/usr/bin/env python
"""The docs site's benchmark pages, made from the results files: one Markdown page per benchmark with its plots
(SVG), an overview with the headline figures, and the README's headline plot.

    python bench/pages.py                  # reads bench/results/, writes docs/benchmarks/
    python bench/pages.py --out /tmp/pages # elsewhere

Every figure comes from a results file, and the page says which, with the command that made it, the commit, the
machine's load and the configuration, as the file records them (where a file does not record its command, the
page derives it from the benchmark's own recording code and says so). Where a benchmark has several results
files, each figure uses the newest that measured it (bench/pages_core.py: load) and the rest are listed as
earlier runs. The output is the same bytes for the same results; tests/integration/test_bench_pages.py checks
that docs/benchmarks/ is up to date with bench/results/.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import pages_compare  # noqa: E402
import pages_misc  # noqa: E402
import pages_plot as plot  # noqa: E402
import pages_robust  # noqa: E402
import pages_tables  # noqa: E402
from pages_core import RESULTS, ROOT, Page, Result, code, load, section, short_commit, source, table  # noqa: E402

OUT = ROOT / "docs" / "benchmarks"
# A results file's family is the first prefix its name starts with; no prefix: "other".
PREFIXES = [("soak_cpu", "cpu"), ("ci_cpu", "cpu"), ("network", "network"), ("peers", "peers"),
            ("dataplane", "dataplane"), ("host_shards", "host_shards"), ("pullpush", "pullpush"),
            ("shard_threads", "pullpush"), ("calls", "calls"),
            ("gpu-check", "device"), ("soak", "soak"), ("resize", "resize"), ("journal", "journal"),
            ("replication", "replication"), ("serving", "serving"), ("freshness", "freshness"), ("ctr_ssd", "ctr_ssd"),
            ("ctr", "ctr"),
            ("memory", "memory"), ("compression_accuracy", "compression"), ("embedding", "embedding"),
            ("modes", "modes"), ("startup", "startup"), ("scale", "scale")]
# The pages in the overview's order: family, what makes its page from {family: its results, oldest first}.
PAGES = [
    ("network", lambda by: pages_compare.network_page(by["network"])),
    ("peers", lambda by: pages_compare.peers_page(by["peers"])),
    ("dataplane", lambda by: pages_compare.dataplane_page(by["dataplane"])),
    ("pullpush", lambda by: pages_misc.pullpush_page(by["pullpush"])),
    ("calls", lambda by: pages_misc.calls_page(by["calls"])),
    ("host_shards", lambda by: pages_misc.host_shards_page(by["host_shards"])),
    ("device", lambda by: pages_misc.device_page(by["device"])),
    ("soak", lambda by: pages_robust.soak_page(by["soak"])),
    ("resize", lambda by: pages_robust.resize_page(by["resize"], by["soak"])),
    ("memory", lambda by: pages_robust.memory_page(by["memory"])),
    ("journal", lambda by: pages_robust.journal_page(by["journal"])),
    ("replication", lambda by: pages_robust.replication_page(by["replication"])),
    ("serving", lambda by: pages_misc.serving_page(by["serving"])),
    ("freshness", lambda by: pages_misc.freshness_page(by["freshness"])),
    ("ctr", lambda by: pages_misc.ctr_page(by["ctr"])),
    ("ctr_ssd", lambda by: pages_tables.ctr_ssd_page(by["ctr_ssd"])),
    ("compression", lambda by: pages_misc.compression_page(by["compression"])),
    ("embedding", lambda by: pages_misc.embedding_page(by["embedding"])),
    ("modes", lambda by: pages_misc.modes_page(by["modes"])),
    ("startup", lambda by: pages_misc.startup_page(by["startup"])),
    ("scale", lambda by: pages_misc.scale_page(by["scale"])),
    ("cpu", lambda by: pages_misc.cpu_page(by["cpu"])),
    ("other", lambda by: pages_misc.other_page(by["other"])),
]


def family(name: str) -> str:
    """The benchmark a results file (or folder) `name` belongs to."""
    return next((fam for prefix, fam in PREFIXES if name.startswith(prefix)), "other")


def build(results: list[Result]) -> tuple[list[tuple[str, Page, list[Result]]], Page]:
    """Every family's page (with the results it was made from), and the overview."""
    by: dict[str, list[Result]] = {fam: [] for fam, _ in PAGES}
    for r in results:
        by[family(r.name)].append(r)
    pages = [(fam, make(by), by[fam]) for fam, make in PAGES if by[fam]]
    return pages, overview(pages, by)


def overview(pages: list[tuple[str, Page, list[Result]]], by: dict[str, list[Result]]) -> Page:
    """index.md: the headline plot, every page's headline figures with their results files, and the pages."""
    page = Page.start(
        "index.md", "Benchmarks",
        "Figures from the benchmark scripts in `bench/`, as their results files in `bench/results/` record "
        "them. Most ran on the 2-core development machine, shared with other work: compare the ratios measured "
        "within one run (torchps beside TensorFlow, interleaved), not absolute figures across runs. Each page "
        "states, for each figure, the results file it comes from, the command, the commit, the machine's load "
        "and the configuration.")
    draw, used = pages_compare.headline(by["network"], by["dataplane"])
    if draw is not None:
        page.figures["headline.svg"] = draw
        page.lines += ["![torchps beside TensorFlow per link: steps/s and CPU per step](headline.svg)", "",
                       "Per link, torchps (fp32, defaults) over TensorFlow's ParameterServerStrategy, each from "
                       "the newest run that measured it: training the 25.3M-parameter MLP (1 ps, 2 async workers; "
                       "[details](network.md)) and moving it with no compute ([details](dataplane.md)). "
                       "Training's CPU ratio is that of the CPU per step figures on its page.", "",
                       *section("How this was measured", [source(r) for r in used], level=2)]
    page.lines += ["## Headline figures", "",
                   *table(["figure", "value", "results file", "commit", "page"],
                          [[what, value, code(r.name), short_commit(r), f"[{p.title}]({p.file})"]
                           for _, p, _ in pages for what, value, r in p.headline]),
                   "## Pages", "",
                   *table(["page", "results files", "newest"],
                          [[f"[{p.title}]({p.file})", len(results), code(results[-1].name)]
                           for _, p, results in pages]),
                   "## How these pages are made", "",
                   "`python bench/pages.py` writes this folder from `bench/results/`; "
                   "`tests/integration/test_bench_pages.py` fails while it is out of date, so a new results file "
                   "comes with its pages. The newest results file of a benchmark: the one whose last change was "
                   "committed last (one not yet committed counts as newest), then the one whose recorded commit "
                   "is newer, then by name. A figure of several setups or links takes each from the newest file "
                   "that measured it; ratios are always between figures of one run.", ""]
    return page


def write(out: pathlib.Path, results_dir: pathlib.Path = RESULTS) -> list[pathlib.Path]:
    """Write every page and figure into `out` and remove the pages and figures it no longer makes; returns the
    files written."""
    plot.style()
    pages, index = build(load(results_dir))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for page in [index, *(p for _, p, _ in pages)]:
        text = "\n".join(["<!-- Made by bench/pages.py from bench/results/: edit that, not this. -->", "",
                          *page.lines]).rstrip() + "\n"
        while "\n\n\n" in text:
            text = text.replace("\n\n\n", "\n\n")
        (out / page.file).write_text(text)
        written.append(out / page.file)
        for name, make in page.figures.items():
            plot.save(make(), out / name)
            written.append(out / name)
    for stale in sorted({*out.glob("*.md"), *out.glob("*.svg")} - set(written)):
        stale.unlink()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="where the pages go (default docs/benchmarks)")
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS, help="the results (default bench/results)")
    args = parser.parse_args(argv)
    written = write(args.out, args.results)
    print(f"wrote {len(written)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
