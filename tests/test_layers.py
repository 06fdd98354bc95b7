"""The import layers of the README's module map, read from the source (ast, every import
statement, also those inside functions): erpo_kernels imports neither erpo nor bench;
erpo imports neither bench nor tests; the modules of erpo/ import each other without a
cycle. No file cites a document the repository lacks; no function in erpo/ reaches 60
lines."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("erpo_kernels", "erpo", "bench", "tests")
# what each layer may not import
FORBIDDEN = {"erpo_kernels": {"erpo", "bench", "tests"}, "erpo": {"bench", "tests"}}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _python_files(package: str):
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def imports_of(path: str):
    """Absolute names of the modules `path` imports (relative imports resolved; `from
    pkg import name` counted as pkg.name, which is pkg's module when there is one)."""
    module = _module_name(path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _graph(package: str):
    modules = {_module_name(p): p for p in _python_files(package)}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in imports_of(path) if m in modules and m != name and m != package}
    return graph


def test_no_upward_import():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in _python_files(package):
            for name in imports_of(path):
                if name.split(".")[0] in forbidden:
                    bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert not bad, bad


def find_cycle(graph):
    """A list of modules forming a cycle, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_cycle_within_erpo():
    cycle = find_cycle(_graph("erpo"))
    assert cycle is None, " -> ".join(cycle)
    # models is the bottom of the model stack: tiny, trainer and evaluate import it, not the reverse
    graph = _graph("erpo")
    assert "erpo.models" in graph["erpo.tiny"] and "erpo.models" in graph["erpo.trainer"]
    assert not graph["erpo.models"] & {"erpo.tiny", "erpo.trainer", "erpo.evaluate"}


def test_the_checks_see_what_they_look_for(tmp_path):
    # a cycle and an upward import are found (so the tests above could fail)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    names = imports_of(os.path.join(ROOT, "erpo", "trainer.py"))
    assert "erpo.models" in names and "erpo_kernels" in names


def test_every_cited_document_exists():
    """Documents cited by path under docs/, and any method page cited by name, are in the repository."""
    missing = []
    for package in PACKAGES:
        for path in _python_files(package):
            with open(path, encoding="utf-8") as f:
                cited = re.findall(r"\b(docs/[\w./-]+\.md|[\w-]*method[\w-]*\.md)\b", f.read())
            missing += [f"{os.path.relpath(path, ROOT)} cites {doc}" for doc in cited
                        if not os.path.isfile(os.path.join(ROOT, doc))]
    assert not missing, missing


def test_every_function_in_erpo_is_under_60_lines():
    long = []
    for path in _python_files("erpo"):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines >= 60:
                    long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
