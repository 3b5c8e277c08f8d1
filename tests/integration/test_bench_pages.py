"""bench/pages.py: every results file lands on its benchmark's page, every plot a page shows is there and is an
SVG, the pages and plots quote the results files' own figures, the output is the same bytes each time, and
docs/benchmarks/ is what bench/results/ makes now (a new results file without its pages fails here)."""

import json
import pathlib
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

matplotlib = pytest.importorskip("matplotlib", reason="bench/pages.py draws with matplotlib (the docs extra)")

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
DOCS = ROOT / "docs" / "benchmarks"
sys.path.insert(0, str(BENCH))
import pages  # noqa: E402
import pages_core  # noqa: E402

IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> pathlib.Path:
    """The pages and plots as `python bench/pages.py --out DIR` makes them from bench/results/ (in this process:
    matplotlib is imported once)."""
    out = tmp_path_factory.mktemp("pages")
    assert pages.main(["--out", str(out)]) == 0
    return out


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_every_results_file_is_named_on_its_benchmark_s_page(made):
    built, _ = pages.build(pages_core.load(RESULTS))
    page_of = {family: page.file for family, page, _ in built}
    entries = [p.name for p in RESULTS.iterdir() if p.suffix == ".json" or p.is_dir()]
    assert entries
    for name in entries:
        page = made / page_of[pages.family(name)]
        assert re.search(rf"[`/]{re.escape(name)}[`/]", page.read_text()), f"{name} is not on {page.name}"
    index = (made / "index.md").read_text()
    assert all(f"]({file})" in index for file in page_of.values())


def test_every_plot_a_page_shows_is_there_and_is_an_svg(made):
    shown = set()
    for page in made.glob("*.md"):
        for target in IMAGE.findall(page.read_text()):
            assert (made / target).is_file(), f"{page.name} shows {target}, which is not there"
            shown.add(target)
    svgs = {p.name for p in made.glob("*.svg")}
    assert shown == svgs and "headline.svg" in svgs
    for name in svgs:
        root = ElementTree.parse(made / name).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg", name


def test_the_pages_and_plots_quote_the_results_files(made):
    calls_page = (made / "calls.md").read_text()
    calls = json.loads((ROOT / re.search(r"Results: `(bench/results/[^`]+)`", calls_page)[1]).read_text())
    push = calls["torchps"]["push"]
    assert (f"| torchps push | {push['wall_ms']:.3f} | {push['client_cpu_ms']:.3f} | {push['server_cpu_ms']:.3f} |"
            in calls_page)
    # the peers table's 25.3M MLP fp32 row names its results file; its ratio is that file's, on the page and plot
    row = next(line for line in (made / "peers.md").read_text().splitlines()
               if line.startswith("| 25.3M MLP, 1 ps | fp32 |"))
    peers = json.loads((RESULTS / re.search(r"`([^`]+\.json)`", row)[1]).read_text())
    ratio = f"{peers['big_ratio_fp32']:.2f}"
    assert f"| {ratio} |" in row
    assert re.search(rf">\s*{re.escape(ratio)}\s*<", (made / "peers-ratio.svg").read_text())


def test_the_same_results_make_the_same_bytes(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name in ("calls.json", "startup.json"):  # a plot and a table, quickly
        shutil.copy(RESULTS / name, results / name)
    pages.write(tmp_path / "one", results)
    pages.write(tmp_path / "two", results)
    one = _files(tmp_path / "one")
    assert set(one) == {"calls-cpu.svg", "calls.md", "startup.md", "index.md"}
    assert one == _files(tmp_path / "two")


def test_a_results_file_no_page_knows_gets_its_figures_in_a_table(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "mystery.json").write_text(json.dumps({"command": "python bench/mystery.py", "speed": 1.25}))
    pages.write(tmp_path / "out", results)
    other = (tmp_path / "out" / "other.md").read_text()
    assert "`mystery.json`" in other and "| `speed` | 1.250 |" in other and "`python bench/mystery.py`" in other
    assert "(other.md)" in (tmp_path / "out" / "index.md").read_text()


def test_docs_benchmarks_is_up_to_date_with_bench_results(made):
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                             text=True).stdout.strip()
    if shallow == "true":
        pytest.skip("a shallow clone lacks the history that orders the results files")
    want, have = _files(made), _files(DOCS) if DOCS.is_dir() else {}
    stale = sorted(name for name in want.keys() | have.keys() if want.get(name) != have.get(name))
    assert not stale, (f"docs/benchmarks/ differs from what bench/results/ makes ({', '.join(stale)}): run "
                       "`python bench/pages.py` and commit docs/benchmarks/ with the results (plots that differ "
                       f"alone may come from another matplotlib than this {matplotlib.__version__})")
