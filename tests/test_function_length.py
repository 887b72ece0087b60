"""No function of jtbo is longer than ``MAX_LINES`` lines, but the listed exemptions.

A function's length is its ``def`` line to its last line, docstring included (``ast``'s
``end_lineno - lineno + 1``). The exemptions must stay true: an entry whose function is gone
or no longer too long fails too, so the lists cannot rot.
"""

import ast
import pathlib

MAX_LINES = 60
ROOT = pathlib.Path(__file__).resolve().parent.parent
EXEMPT = {
    "jtbo/attention/extend.py::_extend_attention_kernel": "a Pallas kernel body: one program",
    "jtbo/attention/paged.py::_paged_attention_kernel": "a Pallas kernel body: one program",
    "jtbo/attention/triton_kernels.py::jtbo_paged_attention_kernel": "a Triton kernel body",
    "jtbo/attention/triton_kernels.py::jtbo_extend_attention_kernel": "a Triton kernel body",
    "jtbo/kernels/grouped_gemm_mosaic.py::_grouped_matmul_body": "a Mosaic GPU kernel body",
    "jtbo/kernels/grouped_gemm_mosaic_fp8.py::_fp8_matmul_body": "a Mosaic GPU kernel body",
}


def _functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, lines)`` of every function in ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def _lengths() -> dict[str, int]:
    """Every jtbo function's length, keyed ``path::qualified name`` (longest of a name)."""
    lengths: dict[str, int] = {}
    for path in sorted((ROOT / "jtbo").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for name, lines in _functions(ast.parse(path.read_text(), relative)):
            key = f"{relative}::{name}"
            lengths[key] = max(lines, lengths.get(key, 0))
    return lengths


def test_no_function_is_longer_than_the_limit():
    exempt = EXEMPT.keys()
    long = {k: n for k, n in _lengths().items() if n > MAX_LINES and k not in exempt}
    assert not long, f"functions over {MAX_LINES} lines (split them into helpers): {long}"


def test_every_exemption_is_still_needed():
    lengths = _lengths()
    stale = [k for k in EXEMPT if lengths.get(k, 0) <= MAX_LINES]
    assert not stale, f"exempt but gone or no longer over {MAX_LINES} lines: {sorted(stale)}"


def test_the_runner_constructor_is_at_most_40_lines():
    # ModelRunner is a facade: its constructor resolves the options once and builds its parts.
    lengths = _lengths()
    assert lengths["jtbo/runner/runner.py::ModelRunner.__init__"] <= 40
