"""Check the package's import rules (docs/architecture.md) from the source's imports; exit 1 on a violation.

Every import counts, at module level or inside a function:
- the folders' allowed directions (FORBIDDEN below: layers/ is pure tensor code, loading is below running, ...);
- no circle between the package's parts (each folder is one part, each module at the package root another);
- an import inside a function only where the imported module needs an optional dependency (triton, the built
  native engine) or where a command defers what it runs until it runs (commands/, cli.py: the CLI starts fast).

    python3 scripts/check_layering.py [src/hybridmoe]
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "hybridmoe"

FORBIDDEN = {
    "layers": {"experts", "models", "distributed", "weights", "system", "engine", "server", "commands", "bench",
               "checkpoint"},
    "experts": {"models", "distributed", "weights", "system", "engine", "server", "commands", "bench", "checkpoint"},
    "models": {"distributed", "weights", "system", "engine", "server", "commands", "bench", "checkpoint"},
    "distributed": {"weights", "system", "engine", "server", "commands", "bench", "checkpoint", "hf"},
    "weights": {"system", "engine", "server", "commands", "bench"},
    "system": {"engine", "server", "commands", "bench"},
    "engine": {"server", "commands", "bench"},
    "server": {"commands", "bench"},
    "checkpoint": {"layers", "experts", "models", "distributed", "weights", "system", "engine", "server", "commands",
                   "bench"},
    "hf": {"models", "distributed", "system", "engine", "server", "commands", "bench", "checkpoint"},
}
"""part -> the parts it must never import (each folder of the package is a part). distributed/ (tensor parallelism)
replaces a built model's layers by their shards and wraps its expert backend: it sits above models/ and below
weights/ and engine/, which call it (the loader shards a rank's model; the engine starts the workers); the workers
get the engine's loader handed in, never imported."""

NEUTRAL = {"errors", "config", "platform", "forward_context", "sampling_params", "tokenizer", "tokenizer_tiktoken",
           "_native"}
"""Modules at the package root that every part may import: they import nothing above them."""

OPTIONAL_DEPENDENCIES = {"triton", "gguf", f"{PACKAGE}._native"}
"""A module that imports one of these at module level, itself or through the modules it imports so, may be imported
inside a function: triton and the built native engine may be missing (the caller checks first); gguf is installed
with hybridmoe but only GGUF files need it, so a load of any other format never imports it."""

DEFERRING_PARTS = {"commands", "cli"}


@dataclass(frozen=True)
class Import:
    source: str
    """Importing module, dotted."""
    target: str
    """Imported module, dotted (for `from a import b`, a.b when that is a module, else a)."""
    line: int
    in_function: bool

    def where(self, root: Path) -> str:
        return f"{root / Path(*self.source.split('.')[1:])}.py:{self.line}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """hybridmoe.layers.attention -> layers; hybridmoe.config -> config; hybridmoe -> the package root ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def collect(root: Path) -> tuple[list[Import], dict[str, set[str]]]:
    """Every import of a package module, and each module's module-level imports of anything (for optional deps)."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    imports, top_level = [], {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        function_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                          for n in ast.walk(f)}
        top_level[name] = set()
        for node in ast.walk(tree):
            for target in _targets(node, package, modules):
                in_function = id(node) in function_nodes
                if not in_function:
                    top_level[name].add(target)
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    imports.append(Import(name, target, node.lineno, in_function))
    return imports, top_level


def _targets(node: ast.AST, package: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
    if module == PACKAGE and any(a.name == "_native" for a in node.names):
        subs.append(f"{PACKAGE}._native")
    return subs or [module]


def needs_optional(module: str, top_level: dict[str, set[str]], seen: frozenset = frozenset()) -> bool:
    """Whether importing module imports an optional dependency, directly or through its module-level imports."""
    if module in OPTIONAL_DEPENDENCIES or module.split(".")[0] in OPTIONAL_DEPENDENCIES:
        return True
    return any(needs_optional(t, top_level, seen | {module}) for t in top_level.get(module, ()) if t not in seen)


def violations(root: Path) -> list[str]:
    imports, top_level = collect(root)
    found = []
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        src, dst = part_of(imp.source), part_of(imp.target)
        if dst == "" or src == dst:
            if dst == "" and src != "":
                found.append(f"{imp.where(root)}: {imp.source} imports the package root (__init__): import the module")
            continue
        if src in FORBIDDEN and dst in FORBIDDEN[src]:
            found.append(f"{imp.where(root)}: {src}/ must not import {dst}/ ({imp.source} -> {imp.target})")
        if src in NEUTRAL and dst not in NEUTRAL:
            found.append(f"{imp.where(root)}: the neutral module {imp.source} imports {imp.target}")
        edges.setdefault(src, {}).setdefault(dst, imp)
    for imp in imports:
        if imp.in_function and part_of(imp.source) not in DEFERRING_PARTS and not needs_optional(imp.target, top_level):
            found.append(f"{imp.where(root)}: {imp.source} imports {imp.target} inside a function; import it at "
                         "module level (only modules that need triton, gguf or the native engine are imported late)")
    found += [f"import circle between parts: {' -> '.join(c)} (first import: {edges[c[0]][c[1]].where(root)})"
              for c in _circles(edges)]
    return found


def _circles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One circle through each part that lies on one (depth-first search over the part graph)."""
    circles, done = [], set()
    for start in sorted(edges):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, {})):
                if nxt == start and start not in done:
                    circles.append(path + [start])
                    done.update(path)
                elif nxt not in path and nxt not in done:
                    stack.append((nxt, path + [nxt]))
    return circles


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "src" / PACKAGE
    found = violations(root)
    for line in found:
        print(line)
    print(f"{len(found)} import rule violation(s) in {root}" if found else f"import rules hold in {root}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
