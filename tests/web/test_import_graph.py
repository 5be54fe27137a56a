"""The floors hold: no import circle among the project's modules (module-level and function-level imports
alike), `trainer` and `native_ext` never import Django or `kiln_web`, and no actions module imports a task
or a worker (work is handed over through kiln_web.core.dispatch)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "kiln_web", "native_ext")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _owner(name: str, known: dict) -> str | None:
    """The project module NAME refers to (a module, or the module defining an attribute), or None."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, known: dict) -> dict[str, int]:
    """Project modules NAME imports anywhere in its body -> the first line that does."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            owner = _owner(target, known)
            if owner is not None and owner != name:
                found.setdefault(owner, node.lineno)
    return found


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, dict]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
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


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert circles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_circles_in_any_package():
    edges = graph()
    found = circles(edges)
    described = [" -> ".join(component) + ": " + "; ".join(
        f"{a} imports {b} (line {edges[a][b]})" for a in component for b in component if b in edges[a])
        for component in found]
    assert found == [], "\n".join(described)


def test_trainer_and_native_ext_never_import_django_or_kiln_web():
    offenders = []
    for package in ("trainer", "native_ext"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                              if name.split(".")[0] in ("django", "kiln_web", "channels", "celery")]
    assert offenders == []


def test_actions_modules_import_no_task_or_worker():
    edges = graph()
    offenders = [f"{name} imports {target}" for name, targets in edges.items() if name.endswith(".actions")
                 for target in targets if target.endswith((".tasks", ".worker", ".execution"))]
    assert offenders == []
