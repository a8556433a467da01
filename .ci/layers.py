"""The layer check docs/design.md promises: module-level imports go downward only.

Reads the layer order from the code block under docs/design.md's "## Layers" (the top
layer first; each line names its units before the first run of two spaces, a line that
starts with spaces continues the one above), then every module-level import of
src/rankwise (not under ``TYPE_CHECKING``, not inside a function) between two top-level
units (a package, or a module such as ``errors.py``). Fails on a unit the order does not
name, on an import into a higher layer, and on a cycle between units (which two units of
one layer could form). Usage: python .ci/layers.py [ROOT]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

FACADE = "rankwise"  #: ``rankwise/__init__.py``, named "rankwise (facade)" in the order


def layer_order(design: str) -> dict[str, int]:
    """Unit name -> layer index (0: the top), from the Layers section's code block."""
    section = design.split("\n## Layers\n", 1)[1]
    block = section.split("```", 2)[1]
    order: dict[str, int] = {}
    index = -1
    for line in block.splitlines()[1:]:
        if not line.strip() or line.startswith(" "):
            continue
        index += 1
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        for name in names.split(","):
            order[name.split("(")[0].strip()] = index
    return order


def unit_of(path: Path, pkg: Path) -> str:
    rel = path.relative_to(pkg)
    if rel.parts == ("__init__.py",):
        return FACADE
    return rel.parts[0].removesuffix(".py")


def imported_units(path: Path, pkg: Path) -> set[str]:
    """The top-level units ``path`` imports at module level."""
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    package = parts[:-1]  # the package a relative import starts from
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    nodes: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes.extend(node.orelse)
        else:
            nodes.append(node)
    for node in nodes:
        for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            targets: list[str] = []
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                if n.level:
                    base = package[: len(package) - (n.level - 1)]
                    mod = ".".join(base + ([n.module] if n.module else []))
                else:
                    mod = n.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in n.names]
            for t in targets:
                bits = t.split(".")
                if bits[0] == "rankwise" and len(bits) > 1 and (
                        (pkg / bits[1]).is_dir() or (pkg / f"{bits[1]}.py").is_file()):
                    found.add(bits[1])
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main(root: Path) -> int:
    order = layer_order((root / "docs" / "design.md").read_text())
    pkg = root / "src" / "rankwise"
    problems: list[str] = []
    unplaced: set[str] = set()
    edges: dict[str, set[str]] = {}
    for path in sorted(pkg.rglob("*.py")):
        me = unit_of(path, pkg)
        if me == "__main__":
            continue  # ``python -m rankwise``: above everything, imported by nothing
        if me not in order:
            unplaced.add(me)
            continue
        for other in imported_units(path, pkg) - {me}:
            if other not in order:
                continue  # reported as its own file
            edges.setdefault(me, set()).add(other)
            if order[other] < order[me]:
                problems.append(f"{path.relative_to(root)}: {me} (layer {order[me]}) imports "
                                f"{other} (layer {order[other]}), a higher layer")
    problems += [f"src/rankwise/{u}: in no layer of docs/design.md (## Layers)"
                 for u in sorted(unplaced)]
    for comp in cycles(edges):
        problems.append(f"import cycle between {', '.join(comp)}")
    for p in problems:
        print(p)
    print(f"layers: {len(order)} units in {max(order.values()) + 1} layers, "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent.parent))
