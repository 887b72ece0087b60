"""Docstrings and comments in jtbo/ describe the code: no issue numbers and no dates.

A pointer to a BENCHMARKS.md section by its topic is fine; one by its date is not. The check
reads only docstrings and comments (``ast`` and ``tokenize``), never code or other strings,
so a constant in the code cannot trip it.
"""

import ast
import io
import pathlib
import re
import tokenize

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jtbo"

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
        found += _violations(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "\n".join(found)
