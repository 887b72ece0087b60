"""The layers of ``pyproject.toml``'s import-linter contract, in the text of the code too: no
module names a module of a higher layer, in its imports (``lint-imports`` checks those), its
docstrings or its comments. A command a user types (``python -m jtbo.bench ...``) may be
named anywhere."""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MENTION = re.compile(r"(?<!python -m )\bjtbo\.([a-z_]+)")


def _layer_ranks() -> dict[str, int]:
    """Top-level module name -> its layer's rank, 0 at the bottom."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if "containers" not in c]  # the packages' layers
    ranks = {}
    for rank, layer in enumerate(reversed(contract["layers"])):
        for name in layer.split("|"):
            ranks[name.strip().removeprefix("jtbo.")] = rank
    return ranks


def _upward_mentions(ranks: dict[str, int], root: pathlib.Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / "jtbo").rglob("*.py")):
        relative = path.relative_to(root / "jtbo")
        own = ranks.get(relative.parts[0].removesuffix(".py"))
        if own is None:  # jtbo/__init__.py lists every layer
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for mention in MENTION.finditer(line):
                if ranks.get(mention.group(1), -1) > own:
                    found.append(f"jtbo/{relative}:{number}: {mention.group(0)}")
    return found


def test_every_package_is_in_a_layer():
    ranks = _layer_ranks()
    packages = {p.name for p in (ROOT / "jtbo").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "jtbo").glob("*.py") if p.stem != "__init__"}
    assert packages | modules <= set(ranks), sorted(packages | modules - set(ranks))


def test_no_module_names_a_higher_layer():
    assert _upward_mentions(_layer_ranks()) == []


def test_the_check_finds_a_mention_of_a_higher_layer(tmp_path):
    ranks = _layer_ranks()
    assert ranks["runner"] > ranks["kernels"]
    fake = tmp_path / "jtbo" / "kernels"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text(
        '"""Sized by ``jtbo.runner.planning``; see python -m jtbo.bench."""\n'
    )
    assert _upward_mentions(ranks, tmp_path) == ["jtbo/kernels/x.py:1: jtbo.runner"]
