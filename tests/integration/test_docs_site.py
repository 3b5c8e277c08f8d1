"""The docs site: `mkdocs build --strict` (mkdocs.yml) builds it with no warning, so a broken link, a missing
anchor or an API entry whose object moved fails here; every page is in the navigation (the benchmark pages
through their index); the README's links point at files that exist; the command reference is what the
commands print."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MKDOCS = pathlib.Path(sys.executable).parent / "mkdocs"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")

needs_mkdocs = pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed: pip install -e '.[docs]'")


def nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


class _Loader(yaml.SafeLoader):
    """mkdocs.yml may hold !!python/name tags (mkdocs-material's emoji options): read them as text."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


@needs_mkdocs
def test_the_site_builds_strict(tmp_path):
    result = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                            capture_output=True, text=True, timeout=240, env={"NO_MKDOCS_2_WARNING": "1",
                                                                              "PATH": str(MKDOCS.parent)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").read_text().count("PSClient") > 10


def test_every_page_is_in_the_navigation():
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_Loader)
    listed = set(nav_pages(config["nav"]))
    missing = [p for p in listed if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    benchmarks_index = (DOCS / "benchmarks" / "index.md")
    linked_from_index = set()
    if benchmarks_index.exists():
        linked_from_index = {f"benchmarks/{target}" for target in LINK.findall(benchmarks_index.read_text())}
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    orphans = sorted(pages - listed - linked_from_index)
    assert not orphans, f"pages no reader can reach (add them to mkdocs.yml's nav): {orphans}"


def test_the_readme_links_point_at_files():
    readme = (REPO / "README.md").read_text()
    targets = [t for t in LINK.findall(readme) if not t.startswith(("http://", "https://"))]
    assert targets, "the README links into the docs"
    broken = [t for t in targets if not (REPO / t).exists()]
    assert not broken, f"README links to files that do not exist: {broken}"
    assert len(readme.splitlines()) <= 300, "the README is the front page: keep it to 300 lines, depth in docs/"


def test_the_command_reference_is_what_the_commands_print():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_cli_reference.py"), "--check"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
