"""docs/troubleshooting.md quotes only messages the code prints, and names every exception of torchps/errors.py.

Every line of the page's ```text blocks is one message as a program prints it, `<...>` standing for what
varies (a path, a number, a part left out). Each fixed part between placeholders of at least MIN_CHARS
characters must be made of the string literals of torchps/, ps_server/, client/, worker/ and serving/ (docstrings
aside): a substring of one literal, or pieces of literals joined where a literal or one of its format fields
(f-string fields, %-style directives) ends, as "ps-server: error: " + "no shard index: ..." are; such pieces
are MIN_PIECE characters long on average, and a whole literal between two others is a joint (". ") or a value
of MIN_WORD characters or more, so that loose words ("it", "the ") cannot make up a sentence. A message the
code no longer prints, or prints in other words, fails here. Pure file reads (ast): no process starts.
"""

from __future__ import annotations

import ast
import bisect
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "troubleshooting.md"
CODE = ("torchps", "ps_server", "client", "worker", "serving")
GENERATED = REPO / "torchps" / "proto"
MIN_CHARS = 15  # shorter fixed parts (", ", " s (") are in any code: they prove nothing
PLACEHOLDER = re.compile(r"<[^<>]*>")
MIN_PIECE = 8  # characters per piece, on average, of a part made of several literals
MIN_WORD = 6   # characters of a whole literal with letters that joins two others
PERCENT = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdigfrxe]")  # a %-style directive of a log line


def page_messages(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every non-empty line of the page's ```text blocks."""
    messages, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            inside = not inside and line == "```text"
        elif inside and line.strip():
            messages.append((number, line.strip()))
    return messages


def code_literals() -> set[str]:
    """Every string literal of the code (f-strings' fixed parts, each on its own), docstrings and other
    bare-expression strings and format specs left out, and the pieces of %-style ones between their
    directives."""
    literals: set[str] = set()
    for folder in CODE:
        for path in (REPO / folder).rglob("*.py"):
            if GENERATED in path.parents:
                continue
            tree = ast.parse(path.read_text(), str(path))
            bare = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
            bare |= {id(part) for node in ast.walk(tree) if isinstance(node, ast.FormattedValue) and node.format_spec
                     for part in ast.walk(node.format_spec)}  # ":.1f", "x": not text
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in bare:
                    literals.add(node.value)
                    literals.update(PERCENT.split(node.value.replace("%%", "%")))
    literals.discard("")
    return literals


def _may_stand_between(literal: str) -> bool:
    """A whole literal may join two others if it is a joint (no letter: ". ", ">= 1") or a value long enough
    to say something ("full disk"), not a word such as "it" or "the "."""
    return len(literal) >= MIN_WORD or not re.search("[A-Za-z]", literal)


class Literals:
    """Asks whether a text is made of the code's literals (see the module docstring)."""

    def __init__(self, literals: set[str]):
        self.whole = literals
        self.corpus = "\0".join(sorted(literals))
        self.forward = sorted(literals)
        self.backward = sorted(s[::-1] for s in literals)

    @staticmethod
    def _starts_one(sorted_literals: list[str], text: str) -> bool:
        at = bisect.bisect_left(sorted_literals, text)
        return at < len(sorted_literals) and sorted_literals[at].startswith(text)

    def pieces(self, text: str) -> int | None:
        """The fewest pieces `text` is made of: 1 if it is in one literal; else a literal's end, whole
        literals (each a joint, ". ", or a value of MIN_WORD characters or more), then a literal's start
        (breadth first over where the pieces meet). None if none make it."""
        if text in self.corpus and "\0" not in text:
            return 1
        layer = [i for i in range(1, len(text)) if self._starts_one(self.backward, text[:i][::-1])]
        seen, count = set(layer), 2
        while layer:
            if any(self._starts_one(self.forward, text[i:]) for i in layer):
                return count
            following = []
            for i in layer:
                for j in range(i + 1, len(text)):
                    if j not in seen and text[i:j] in self.whole and _may_stand_between(text[i:j]):
                        seen.add(j)
                        following.append(j)
            layer, count = following, count + 1
        return None

    def made_of(self, text: str) -> bool:
        """`text` is made of the code's literals, in pieces of MIN_PIECE characters on average: short words
        standing alone in the code ("it", "the ") do not make up a sentence the code never printed."""
        count = self.pieces(text)
        return count is not None and count * MIN_PIECE <= len(text)


def unknown_parts(message: str, literals: Literals) -> list[str]:
    """The fixed parts of `message` (MIN_CHARS or longer) the code's literals do not make."""
    return [part for part in PLACEHOLDER.split(message) if len(part) >= MIN_CHARS and not literals.made_of(part)]


def test_every_message_on_the_page_is_one_the_code_prints():
    text = PAGE.read_text()
    assert "```bash" not in text, "no bash blocks on this page: the docs tests run every bash line"
    fences = {line for line in text.splitlines() if line.startswith("```") and line != "```"}
    assert fences == {"```text"}, f"quote messages in ```text blocks only (checked here): {fences}"
    messages = page_messages(text)
    assert len(messages) >= 50, "the page quotes the messages a user meets"
    literals = Literals(code_literals())
    unchecked = [f"line {n}: {m}" for n, m in messages
                 if not any(len(part) >= MIN_CHARS for part in PLACEHOLDER.split(m))]
    assert not unchecked, f"quote at least {MIN_CHARS} fixed characters of each message: {unchecked}"
    missing = [f"line {n}: {part!r}" for n, m in messages for part in unknown_parts(m, literals)]
    assert not missing, "the page quotes text the code does not print (reworded, or gone):\n" + "\n".join(missing)


def test_every_exception_of_the_hierarchy_is_named_on_the_page():
    tree = ast.parse((REPO / "torchps" / "errors.py").read_text())
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    text = PAGE.read_text()
    absent = [name for name in classes if not re.search(rf"\b{name}\b", text)]
    assert len(classes) > 20 and not absent, f"say what these mean and what to do about them: {absent}"


def test_the_check_refuses_what_the_code_does_not_print():
    """The rule itself: a literal's text passes, as do literals joined at their ends; a reworded one does not."""
    literals = Literals({"no shard index: pass --index N", "ps-server: error: ", ": error: ", " (see ", "ps-certs",
                         " --help)", "--grace is for --rotate"})
    assert literals.made_of("no shard index: pass --index")
    assert literals.made_of("ps-server: error: no shard index: pass --index N")
    assert literals.made_of("ps-certs: error: --grace is for --rotate (see ps-certs --help)")
    assert not literals.made_of("no shard index; pass --index N")
    assert not literals.made_of("ps-server: error: no shard number: pass --index N")
    joined = Literals({"a shard ", "restarting", "it", " stops"})
    assert joined.made_of("a shard restarting stops") and not joined.made_of("a shard it stops")
