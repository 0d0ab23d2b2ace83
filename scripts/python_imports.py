#!/usr/bin/env python3
"""The import graph of the Python package, read from the sources (nothing is
imported): which bagua module imports which at module level.

    python3 scripts/python_imports.py --cycles     # every import circle; exit 1 if any
    python3 scripts/python_imports.py --layers     # imports against the layer order; exit 1 if any goes up
    python3 scripts/python_imports.py --modules    # every module name, one per line

Every import counts, also those inside functions (they run later, but the
two files still depend on each other): a circle means neither file can be
read or changed alone. ``from bagua.x import y`` is an
edge to ``bagua.x.y`` when that is a module, else to ``bagua.x`` (its
``__init__``). A package's ``__init__`` gathers its submodules' names for
users: edges from a package to its own submodules are left out of the
circle check (Python imports the package first by design).
The algorithms live in ``algorithms/`` and are ``bagua.torch_api.algorithms``.
"""

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [(ROOT / "py" / "bagua", "bagua"), (ROOT / "algorithms", "bagua.torch_api.algorithms")]

# The layers, bottom first (docs/architecture.md, "The Python layers"): a
# module may import its own layer and the layers below it, never above.
LAYERS = [
    ("base", ["bagua.version", "bagua.bagua_define", "bagua.torch_api._core", "bagua.torch_api.env"]),
    ("process groups and communication", [
        "bagua.torch_api._exit", "bagua.torch_api.process_group", "bagua.torch_api._primitives",
        "bagua.torch_api.communication",
        "bagua.torch_api._compat_communication", "bagua.torch_api.utils", "bagua.torch_api.timeline"]),
    ("tensors and buckets", ["bagua.torch_api.tensor", "bagua.torch_api.bucket"]),
    ("the algorithm interface", ["bagua.torch_api.algorithms.registry", "bagua.torch_api.algorithms.base"]),
    ("the data-parallel engine", ["bagua.torch_api.autotune", "bagua.torch_api.data_parallel"]),
    # The public facade: its own imports are all its submodules (exempt).
    ("the torch_api package", ["bagua.torch_api"]),
    ("BlueFog", ["bagua.bluefog"]),
    ("algorithms", ["bagua.torch_api.algorithms"]),
    ("built on the API", ["bagua.torch_api.checkpoint", "bagua.torch_api.contrib", "bagua.torch_api.moe",
                          "bagua.torch_api.ddp_compatible", "bagua.torch_api.fuse_optimizer",
                          "bagua.torch_api.ddp_hooks", "bagua.contrib",
                          "bagua.distributed", "bagua.lightning", "bagua.service", "bagua.autotune"]),
    ("the bagua package", ["bagua"]),
]


def modules():
    """{module name: source path} of every module of the package."""
    found = {}
    for folder, prefix in SOURCES:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if "algorithms" in parts and folder.name == "bagua":
                continue  # the link to algorithms/
            found[".".join([prefix] + parts)] = path
    return found


def _module_level(body):
    """Import statements that run at import time."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    yield from _module_level(child.body if isinstance(child, ast.ExceptHandler) else [child])


def imports_of(name, path, known, deep=True):
    """The bagua modules ``name`` imports: anywhere in it (``deep``), or at
    module level only."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if deep \
        else _module_level(tree.body)
    for node in nodes:
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
        for alias in node.names:
            full = f"{base}.{alias.name}"
            targets.add(full if full in known else base)
    return {t for t in targets if t in known and t != name}


def graph(deep=True):
    known = modules()
    return {name: imports_of(name, path, known, deep) for name, path in known.items()}


def cycles(edges):
    """Every strongly connected set of modules (a circle), ignoring a
    package's edges to its own submodules."""
    def kept(source, target):
        return not target.startswith(source + ".")

    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):  # Tarjan's algorithm
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if not kept(node, target):
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layer_of(name):
    """The index of the layer of ``name``: the longest prefix listed."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def upward(edges):
    """(source, target) pairs where a module imports a higher layer, and the
    modules no layer lists."""
    ups, unplaced = [], sorted(n for n in edges if layer_of(n) is None)
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            if target.startswith(source + "."):
                continue  # a package gathering its own submodules
            s, t = layer_of(source), layer_of(target)
            if s is not None and t is not None and t > s:
                ups.append((source, target))
    return ups, unplaced


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", action="store_true")
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--modules", action="store_true")
    args = parser.parse_args()
    edges = graph()
    status = 0
    if args.modules:
        print("\n".join(sorted(edges)))
    if args.cycles:
        found = cycles(edges)
        for component in found:
            print("import circle: " + " <-> ".join(component))
        print(f"{'no' if not found else len(found)} import circle{'s' if len(found) != 1 else ''} "
              f"among {len(edges)} modules")
        status |= bool(found)
    if args.layers:
        ups, unplaced = upward(edges)
        for source, target in ups:
            print(f"upward import: {source} ({LAYERS[layer_of(source)][0]}) imports {target} "
                  f"({LAYERS[layer_of(target)][0]})")
        for name in unplaced:
            print(f"module in no layer: {name} (add it to LAYERS in scripts/python_imports.py)")
        print(f"{len(ups)} upward imports, {len(unplaced)} modules in no layer")
        status |= bool(ups or unplaced)
    return status


if __name__ == "__main__":
    sys.exit(main())
