"""tools/unused_exports.py on a tiny synthetic package: what counts as a caller."""

import importlib.util
import textwrap
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "unused_exports.py"
_spec = importlib.util.spec_from_file_location("unused_exports", _SCRIPT)
unused_exports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unused_exports)

FILES = {
    "pkg/__init__.py": """
        from pkg.core import unused, used

        __all__ = ["unused", "used"]
    """,
    "pkg/core.py": """
        def used():
            return 1


        def unused():
            return used()
    """,
    "pkg/caller.py": """
        from pkg.core import used

        print(used())
    """,
    "tests/test_core.py": """
        from pkg import unused

        def test_unused():
            assert unused() == 1
    """,
}


@pytest.fixture
def tree(tmp_path):
    for name, text in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def run(root: Path) -> int:
    return unused_exports.main(["--root", str(root), "--package", "pkg"])


def test_reports_only_the_name_used_by_tests_alone(tree, capsys):
    assert unused_exports.unused_exports(tree, "pkg") == ["pkg.core:unused"]
    assert run(tree) == 1
    assert capsys.readouterr().out.splitlines() == ["pkg.core:unused"]


def test_a_caller_outside_tests_passes(tree, capsys):
    (tree / "pkg/caller.py").write_text("from pkg.core import unused, used\n\nused(), unused()\n")
    assert run(tree) == 0
    assert capsys.readouterr().out == ""


def test_a_readme_python_block_is_a_caller(tree):
    (tree / "README.md").write_text("Use it:\n\n```python\nfrom pkg import unused\n```\n")
    assert run(tree) == 0
