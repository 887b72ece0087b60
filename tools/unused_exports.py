"""List the package's exported names that nothing outside tests/ calls (issue 21).

Exported: every name a package ``__init__.py`` re-exports (its ``__all__``, else its public
``from`` imports and definitions that are not submodules), plus every public top-level function
and class of each module an ``__init__.py`` re-exports from. A name has a caller when a .py file
under the package other than its defining module refers to it (``name``, ``x.name``, ``from m
import name``; an ``__init__.py``'s re-export imports and lazy ``__getattr__`` do not count), or
a fenced ``python`` block of README.md does; entry points (``__main__.py``, CLI modules) are
files under the package, so they count. A use inside the defining module counts only when the
module itself has a caller, so a module reached only from tests/ keeps all its names.

Prints the ``module:name`` of each name with no caller and exits 1 if there is one. There is
no allowlist: a name only tests call is removed, made private, or given a caller (an entry
point, or a README example for API meant for users' own code). Standard library only:
``python tools/unused_exports.py``.
"""

import argparse
import ast
import re
import sys
from pathlib import Path

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
Export = tuple[str, str]  # (defining module, name)


def load_modules(root: Path, package: str) -> dict[str, ast.Module]:
    """Every module under ``root/package``, parsed, by dotted name (a package by its own)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = ast.parse(path.read_text(), filename=str(path))
    return modules


def public_defs(tree: ast.Module) -> list[str]:
    """The public top-level functions and classes of a module."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [n.name for n in tree.body if isinstance(n, kinds) and not n.name.startswith("_")]


def bound_names(tree: ast.Module) -> dict[str, tuple[str | None, str]]:
    """Top-level ``from`` imports and definitions: name -> (source module or None, its name)."""
    bound: dict[str, tuple[str | None, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            bound.update({a.asname or a.name: (node.module, a.name) for a in node.names})
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound[node.name] = (None, node.name)
        elif isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            bound.update({t: (None, t) for t in targets})
    return bound


def dunder_all(tree: ast.Module) -> list[str] | None:
    """The string entries of a literal top-level ``__all__``, or None if there is none."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)]
    return None


def resolve(module: str, name: str, modules: dict[str, ast.Module]) -> Export:
    """Where ``name`` in ``module`` is defined, following ``from X import name`` chains."""
    source, original = bound_names(modules[module]).get(name, (None, name))
    if source in modules:
        return resolve(source, original, modules)
    if source is None and name not in bound_names(modules[module]):
        # Lazily exported (a module ``__getattr__``): the first submodule that defines it.
        for other in sorted(m for m in modules if m.startswith(module + ".")):
            if name in bound_names(modules[other]):
                return resolve(other, name, modules)
    return module, name


def exported(modules: dict[str, ast.Module], packages: set[str]) -> set[Export]:
    """Names re-exported by the packages, plus public defs of the modules they come from."""
    exports: set[Export] = set()
    for package in packages:
        tree = modules[package]
        names = dunder_all(tree)
        if names is None:
            names = [n for n in bound_names(tree) if f"{package}.{n}" not in modules]
        exports |= {resolve(package, n, modules) for n in names if not n.startswith("_")}
    sources = {m for m, _ in exports if m not in packages}
    return exports | {(m, n) for m in sources for n in public_defs(modules[m])}


def is_reexport(stmt: ast.stmt) -> bool:
    """An ``__init__.py`` statement that re-exports: a ``from`` import or a lazy ``__getattr__``."""
    lazy = isinstance(stmt, ast.FunctionDef) and stmt.name == "__getattr__"
    return lazy or isinstance(stmt, ast.ImportFrom)


def references(tree: ast.Module, is_init: bool) -> set[str]:
    """Identifiers, attribute names and ``from``-imported names a module refers to."""
    body = [s for s in tree.body if not (is_init and is_reexport(s))]
    found: set[str] = set()
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found.update(a.name for a in node.names)
    return found


def readme_references(readme: Path) -> set[str]:
    """Names in README.md's ``python`` blocks (identifiers, if a block does not parse)."""
    found: set[str] = set()
    text = readme.read_text() if readme.exists() else ""
    for block in FENCE.findall(text):
        try:
            found |= references(ast.parse(block), is_init=False)
        except SyntaxError:  # documentation shorthand such as ``f(a, ...)``
            found |= set(re.findall(r"[A-Za-z_]\w*", block))
    return found


def unused_exports(root: Path, package: str) -> list[str]:
    """``module:name`` of every exported name that has no caller outside tests/."""
    modules = load_modules(root, package)
    packages = {m for m in modules if (root / Path(*m.split(".")) / "__init__.py").exists()}
    refs = {m: references(t, m in packages) for m, t in modules.items()}
    readme = readme_references(root / "README.md")
    exports = exported(modules, packages)
    outside = {
        (m, n) for m, n in exports if n in readme or any(n in r for o, r in refs.items() if o != m)
    }
    live = {m for m, _ in outside}
    called = outside | {(m, n) for m, n in exports if m in live and n in refs[m]}
    return sorted(f"{m}:{n}" for m, n in exports - called)


def main(argv: list[str] | None = None) -> int:
    """Prints the unused exports; returns 1 if there is one, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--package", default="jtbo")
    args = parser.parse_args(argv)
    unused = unused_exports(args.root, args.package)
    for entry in unused:
        print(entry)
    if unused:
        hint = "no caller outside tests/: remove it, make it private, or give it a caller"
        print(f"{len(unused)} unused export(s) above; {hint}", file=sys.stderr)
    return 1 if unused else 0


if __name__ == "__main__":
    sys.exit(main())
