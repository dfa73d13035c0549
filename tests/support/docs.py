"""Reading the Markdown of README.md and docs/ as tests need it: sections,
tables, code spans, links; the agent's own texts, to check a quoted message
against what the code can print; and what the pages (and the man pages) must
match in the code: its commands, exit statuses and configuration defaults."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from cni_agent.cli import exits
from cni_agent.config import AgentConfig

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"


def pages() -> list[Path]:
    """Every documentation page: docs/*.md (the man pages are docs/man/*.rst)."""
    return sorted(DOCS.glob("*.md"))


def section(text: str, title: str) -> str:
    """The body of the Markdown section whose heading is `title` (any level),
    up to the next heading of the same or a higher level (a `#` line inside a
    code block is no heading)."""
    lines = text.splitlines(keepends=True)
    fenced, start, level = False, None, 0
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^(#+) (.*?)\s*$", line)
        if m is None:
            continue
        if start is None and m.group(2) == title:
            start, level = i + 1, len(m.group(1))
        elif start is not None and len(m.group(1)) <= level:
            return "".join(lines[start:i])
    assert start is not None, f"no section {title!r}"
    return "".join(lines[start:])


def without_code_blocks(text: str) -> str:
    """`text` with its fenced code blocks blanked out (a `#` there is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def code_spans(text: str) -> list[str]:
    """The code spans of one line, as CommonMark reads them: a run of N
    backticks up to the next run of exactly N; one space each side stripped
    when both are there (so ``` `` `x` `` ``` is "`x`")."""
    out = []
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text):
        span = m.group(2)
        if len(span) > 1 and span[0] == " " and span[-1] == " " and span.strip():
            span = span[1:-1]
        out.append(span)
    return out


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def column(self, name: str) -> list[str]:
        i = self.header.index(name)
        return [row[i] for row in self.rows]


def _cells(line: str) -> tuple[str, ...]:
    """A table row's cells; `\\|` is a pipe inside a cell (GFM)."""
    inner = line.strip().removeprefix("|").removesuffix("|")
    return tuple(c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner))


def tables(text: str) -> Iterator[Table]:
    """Every GFM table in `text` (outside code blocks)."""
    lines = without_code_blocks(text).splitlines()
    i = 0
    while i + 1 < len(lines):
        if lines[i].startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            header = _cells(lines[i])
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            yield Table(header, tuple(rows))
        else:
            i += 1


def links(text: str) -> list[str]:
    """The targets of the inline links `[text](target)` outside code."""
    prose = re.sub(r"`[^`\n]*`", "", without_code_blocks(text))
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _
    dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", without_code_blocks(text), re.M)}


# --- the agent's own texts ---------------------------------------------------------

HOLE = "\0"  # where a literal has a formatted value (an f-string field, %s, a C macro)
_PERCENT = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdgfirxXc]")


def _python_texts(path: Path) -> Iterator[str]:
    """The string literals of a Python file, f-strings with their fields as
    holes; docstrings left out (they describe, they are not printed)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant):
            docstrings.add(id(node.body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield "".join(str(v.value) if isinstance(v, ast.Constant) else HOLE
                          for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            yield _PERCENT.sub(HOLE, node.value)


_C_LITERAL = re.compile(r'"((?:[^"\\\n]|\\.)*)"')
_C_JOIN = re.compile(r"\s*(?:[A-Z_][A-Z0-9_]*\s*)?")  # whitespace, or a macro between literals


def _c_texts(path: Path) -> Iterator[str]:
    """The string literals of a C file, adjacent ones joined (a macro between
    them is a hole), printf's conversions as holes."""
    text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
    current, end = "", -1
    for m in _C_LITERAL.finditer(text):
        gap = text[end:m.start()] if end >= 0 else None
        piece = bytes(m.group(1), "utf-8").decode("unicode_escape")
        if gap is not None and _C_JOIN.fullmatch(gap):
            current += (HOLE if gap.strip() else "") + piece
        else:
            if end >= 0:
                yield _PERCENT.sub(HOLE, current)
            current = piece
        end = m.end()
    if end >= 0:
        yield _PERCENT.sub(HOLE, current)


@cache
def source_pieces() -> frozenset[str]:
    """Every fixed piece of text the agent, its CLI and the shim can print:
    their string literals split at the holes, whitespace runs as one space."""
    texts = [t for p in sorted((REPO / "agent").rglob("*.py")) for t in _python_texts(p)]
    texts += [t for p in sorted((REPO / "shim").glob("*.c")) for t in _c_texts(p)]
    return frozenset(piece for t in texts for piece in re.sub(r"\s+", " ", t).split(HOLE)
                     if piece)


PLACEHOLDER = re.compile(r"<[^<>]*>")


def fixed_parts(message: str) -> list[str]:
    """A quoted message's fixed parts: split at its `<…>` placeholders, each
    stripped; parts with no letter in them say nothing and are left out."""
    parts = (" ".join(p.split()) for p in PLACEHOLDER.split(message))
    return [p for p in parts if re.search(r"[A-Za-z]", p)]


def printed(part: str, pieces: frozenset[str] | None = None) -> bool:
    """Whether `part` is text the code prints: inside one literal piece, or
    pieces that meet where the code fills a hole with another literal (the
    end of one piece, whole pieces, the start of another: `f"{how}: IPs"`
    with `how` a literal elsewhere). Whole pieces in the middle must say
    something (two characters that are not blanks), or any text could be
    spelled from one-letter pieces."""
    pieces = source_pieces() if pieces is None else pieces
    if any(part in p for p in pieces):
        return True
    middle = [p for p in pieces if len(p.strip()) >= 2]
    reached = {k for p in pieces for k in range(1, len(part)) if p.endswith(part[:k])}
    seen: set[int] = set()
    while reached:
        i = reached.pop()
        if i in seen:
            continue
        seen.add(i)
        rest = part[i:]
        if any(p.startswith(rest) for p in pieces):
            return True
        reached.update(i + len(p) for p in middle if rest.startswith(p))
    return False


# --- what the pages must match in the code -------------------------------------------------


def commands(parser: argparse.ArgumentParser, prefix: str = "") -> Iterator[
        tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of every command, a group's own too ("config check")."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", sub
                yield from commands(sub, f"{prefix}{name} ")


def exit_statuses() -> set[int]:
    """The CLI's exit statuses: cli/exits.py's EXIT_* constants."""
    return {v for k, v in vars(exits).items() if k.startswith("EXIT_")}


def config_defaults(obj: Any = None, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, default) of every configuration key, from the code."""
    obj = AgentConfig() if obj is None else obj
    for f in dataclasses.fields(obj):
        if f.name in ("source", "sources", "origins"):
            continue  # where the values were read, not a key
        key = prefix + ("del" if f.name == "delete" else f.name)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from config_defaults(value, key + ".")
        else:
            yield key, list(value) if isinstance(value, tuple) else value


def documented_defaults(configuration_md: str) -> dict[str, Any]:
    """docs/configuration.md's table of keys (its section "Keys"): `key` | `default` | what."""
    page = section(configuration_md, "Keys")
    table = next(t for t in tables(page) if t.header[:2] == ("key", "default"))
    return {code_spans(k)[0]: yaml.safe_load(code_spans(d)[0]) for k, d, _ in table.rows}
