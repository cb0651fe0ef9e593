"""The import picture of the workspace's packages, checked (the lint session runs it):

1. a package imports another workspace package only where its pyproject declares it (no arrow up
   the dependency direction of docs/architecture.md, whose arrows are those declarations);
2. engines and the rest import no trainer runtime: only rl-core itself, and the packages that
   declare `rl-core[train]`, import `rl_core.train`;
3. no import cycle between the modules of the packages (lazy imports inside functions count).

Run from the repository root: `python .ci/import_graph.py`; prints each fault and exits 1.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

PACKAGES = Path(__file__).resolve().parent.parent / "packages"


def modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every package's src tree."""
    found = {}
    for src in PACKAGES.glob("*/src"):
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The workspace modules `name` imports (the longest known prefix of each imported name)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    wanted: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            wanted += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
            wanted += [base, *(f"{base}.{a.name}" for a in node.names)]
    out = set()
    for target in wanted:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def declared() -> dict[str, tuple[set[str], set[str]]]:
    """Top-level module -> (workspace modules it may import, those it may take `[train]` from)."""
    out = {}
    for pyproject in PACKAGES.glob("*/pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements += extra
        deps, train = set(), set()
        for requirement in requirements:
            match = re.match(r"(rl-[a-z]+)(\[([^\]]*)\])?", requirement)
            if match:
                deps.add(match.group(1).replace("-", "_"))
                if "train" in (match.group(3) or "").split(","):
                    train.add(match.group(1).replace("-", "_"))
        out[project["name"].replace("-", "_")] = (deps, train)
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def faults() -> list[str]:
    known = modules()
    edges = {name: imports(name, path, known) for name, path in known.items()}
    allowed = declared()
    out = []
    for name, targets in sorted(edges.items()):
        top = name.partition(".")[0]
        deps, train = allowed[top]
        for target in sorted(targets):
            other = target.partition(".")[0]
            if other != top and other not in deps:
                out.append(f"{name} imports {target}, but {top.replace('_', '-')} does not declare "
                           f"{other.replace('_', '-')}")
            elif (target == "rl_core.train" or target.startswith("rl_core.train.")) and top != "rl_core" \
                    and "rl_core" not in train:
                out.append(f"{name} imports the trainer runtime {target} (only rl-core[train] users may)")
    out += [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    return out


if __name__ == "__main__":
    problems = faults()
    for problem in problems:
        print(problem)
    print(f"import graph: {len(problems)} fault(s)")
    sys.exit(1 if problems else 0)
