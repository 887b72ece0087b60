"""Docstrings and comments in jtbo/ describe the code: no issue numbers and no dates.

A pointer to a BENCHMARKS.md section by its topic is fine; one by its date is not. The check
reads only docstrings and comments (``ast`` and ``tokenize``), never code or other strings,
so a constant in the code cannot trip it.

A pointer to a benchmark section names one that exists: ``BENCHMARKS.md, "<title>"`` a heading
of BENCHMARKS.md, ``docs/benchmarks/, "<topic>"`` part of a heading of a log there (the logs'
headings carry their dates; the pointer names the topic only). The same holds in docs/*.md.
"""

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jtbo"

FORBIDDEN = (
    ("issue reference", re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)),
    ("ISO date", re.compile(r"\b20\d\d-\d\d-\d\d\b")),
    ("BENCHMARKS.md cited by date", re.compile(r"BENCHMARKS\.md[^.]{0,80}?\b20\d\d-\d\d")),
)


def _texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of each comment and docstring in ``source``."""
    texts = []
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    for token in tokens:
        if token.type == tokenize.COMMENT:
            texts.append((token.start[0], token.string))
    tree = ast.parse(source)
    # A string standing alone as a statement is a docstring: of a module, class or function,
    # or of the constant or field just above it.
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            texts.append((node.lineno, node.value.value))
    return texts


def _violations(source: str, name: str) -> list[str]:
    found = []
    for line, text in _texts(source):
        flat = " ".join(text.split())
        for kind, pattern in FORBIDDEN:
            match = pattern.search(flat)
            if match:
                found.append(f"{name}:{line}: {kind}: {match.group(0)!r}")
    return found


def test_detector_catches_planted_examples():
    planted = '''"""Module (issue 37)."""

X = "2026-11-29"  # a string in code is not checked
Y = 12  # the fix for issues #21
Z = 3
"""Z's docstring, from 2026-12-01."""


def f():
    """See BENCHMARKS.md, "H200s,
    2026-11-30"."""
'''
    found = _violations(planted, "planted")
    kinds = sorted(v.split(": ")[1] for v in found)
    assert kinds == [
        "BENCHMARKS.md cited by date",
        "ISO date",
        "ISO date",
        "issue reference",
        "issue reference",
    ], found
    clean = '''"""Rows of 4096 elements, 128x128 blocks, threshold 0.48 (BENCHMARKS.md, "MLA")."""

DATE = "2026-11-29"  # a constant in code
'''
    assert _violations(clean, "clean") == []


def test_package_docstrings_and_comments_carry_no_issue_numbers_or_dates():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += _violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


# A pointer: the file, then one or more quoted titles (``BENCHMARKS.md, "A"``,
# ``docs/benchmarks/ ("A", "B")``); text after the first unquoted word is not a title.
POINTER = re.compile(r'(BENCHMARKS\.md|docs/benchmarks/)[,(\s]*((?:"[^"]+",?\s*)+)')


def _headings(paths) -> list[str]:
    """The text of every Markdown heading line of ``paths``, ``#`` marks stripped."""
    return [
        line.lstrip("#").strip()
        for path in paths
        for line in path.read_text().splitlines()
        if line.startswith("#")
    ]


def _pointers(text: str) -> list[tuple[str, str]]:
    """``(file, title)`` of every benchmark pointer in ``text`` (whitespace flattened)."""
    flat = " ".join(text.split())
    return [
        (match.group(1), title)
        for match in POINTER.finditer(flat)
        for title in re.findall(r'"([^"]+)"', match.group(2))
    ]


def _resolves(target: str, title: str, summary: list[str], logs: list[str]) -> bool:
    """Whether ``title`` is a heading of BENCHMARKS.md, or part of a log's heading."""
    if target == "BENCHMARKS.md":
        return title in summary
    return any(title.lower() in heading.lower() for heading in logs)


def _stale_pointers(sources: dict[str, str], summary, logs) -> set[tuple[str, str, str]]:
    return {
        (name, target, title)
        for name, text in sources.items()
        for target, title in _pointers(text)
        if not _resolves(target, title, summary, logs)
    }


def _repository_sources() -> dict[str, str]:
    """Every jtbo module's comments and docstrings, and every docs/*.md, by relative path.

    A comment's ``#`` is dropped, so a pointer wrapped over comment lines reads as one.
    """
    sources = {
        str(path.relative_to(ROOT)): "\n".join(
            text.removeprefix("#") for _, text in _texts(path.read_text())
        )
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    for path in sorted((ROOT / "docs").glob("*.md")):
        sources[str(path.relative_to(ROOT))] = path.read_text()
    return sources


def test_pointer_check_catches_planted_examples():
    summary = ["Results", "TBO step model: validation"]
    logs = ["TBO step cost on one H200, 2026-11-29 (fused weights)", "Host planning (CPU)"]
    sources = {
        "ok": 'BENCHMARKS.md, "TBO step model: validation"; docs/benchmarks/ ("TBO step cost\n'
        'on one H200", "host planning"), fused weights, "not a title"',
        "gone": 'BENCHMARKS.md, "Kernels"',
        "moved": 'BENCHMARKS.md ("Results", "Host planning")',
        "missing": 'docs/benchmarks/, "Kernels: the copy kernels"',
    }
    assert _stale_pointers(sources, summary, logs) == {
        ("gone", "BENCHMARKS.md", "Kernels"),
        ("moved", "BENCHMARKS.md", "Host planning"),
        ("missing", "docs/benchmarks/", "Kernels: the copy kernels"),
    }


def test_every_benchmark_pointer_names_an_existing_section():
    summary = _headings([ROOT / "BENCHMARKS.md"])
    logs = _headings(sorted((ROOT / "docs" / "benchmarks").glob("*.md")))
    stale = _stale_pointers(_repository_sources(), summary, logs)
    assert not stale, f"pointers to no such section: {sorted(stale)}"
