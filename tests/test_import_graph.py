"""The shape of the house, read from the code: every module's imports parsed with `ast`.

- No import cycles between the project's modules (imports inside functions count; imports
  under `if TYPE_CHECKING:` do not, they never run).
- Dependencies run one way: models <- lookahead_jax <- (train_lad, train_looped, benchmarks).
  The library (`lookahead_jax`, `models`, `pallas_kernels`, `configs`) imports no training or
  benchmark code, and `models` imports nothing of `lookahead_jax`.
- Imports inside functions only for genuinely optional dependencies (`OPTIONAL`).
- The library reads nothing from a source checkout at run time: no path built from its own
  file's location up into the repository, no `benchmarks/results`.
"""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("lookahead_jax", "models", "pallas_kernels", "configs", "train_lad", "train_looped",
            "benchmarks", "checkpoints")
LIBRARY = ("lookahead_jax", "models", "pallas_kernels", "configs")
TRAINING_AND_BENCHMARKS = ("train_lad", "train_looped", "benchmarks")
# Function-level imports the library may keep: packages that are optional at run time (the
# Pallas GPU/TPU backends, plotting, torch-free Hugging Face parts, the GGUF reader).
OPTIONAL = ("jax.experimental.pallas", "matplotlib", "gguf", "transformers", "tokenizers",
            "jinja2", "tqdm", "pallas_kernels.lookahead_attention")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _sources() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    out[_module_name(path)] = path
    return out


SOURCES = _sources()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: str) -> list[tuple[str, bool]]:
    """(imported module, inside a function?) for every import that can run."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found: list[tuple[str, bool]] = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for a in child.names:  # `from pkg import submodule` imports the submodule
                    sub = f"{child.module}.{a.name}"
                    found.append((sub if sub in SOURCES else child.module, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def project_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in SOURCES}
    for mod, path in SOURCES.items():
        for name, _ in imports_of(path):
            target = name
            while target and target not in SOURCES:  # `import a.b.c` of a non-module name
                target = target.rpartition(".")[0]
            if target and target != mod:
                graph[mod].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_checker_finds_a_cycle_and_a_forbidden_import(tmp_path):
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    src = ("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\n"
           "def f():\n    import train_lad.train\n")
    path = tmp_path / "probe.py"
    path.write_text(src)
    assert imports_of(str(path)) == [("os", False), ("typing", False), ("train_lad.train", True)]


def test_no_import_cycles():
    assert find_cycles(project_graph()) == []


@pytest.mark.parametrize("package", LIBRARY)
def test_library_never_imports_training_or_benchmarks(package):
    bad = [(mod, name) for mod, path in SOURCES.items() if mod.split(".")[0] == package
           for name, _ in imports_of(path) if name.split(".")[0] in TRAINING_AND_BENCHMARKS]
    assert bad == []


def test_models_do_not_import_the_decoding_library():
    bad = [(mod, name) for mod, path in SOURCES.items() if mod.startswith("models")
           for name, _ in imports_of(path)
           if name.split(".")[0] in ("lookahead_jax", "pallas_kernels")]
    assert bad == []


def test_function_level_imports_only_for_optional_dependencies():
    bad = [(mod, name) for mod, path in SOURCES.items() if mod.split(".")[0] in LIBRARY
           for name, inside in imports_of(path)
           if inside and not any(name == o or name.startswith(o + ".") for o in OPTIONAL)]
    assert bad == []


def test_library_reads_nothing_from_the_repository():
    bad = []
    for mod, path in SOURCES.items():
        if mod.split(".")[0] not in ("lookahead_jax", "models", "pallas_kernels"):
            continue
        text = open(path, encoding="utf-8").read()
        if "benchmarks/results" in text or "dirname(os.path.dirname(os.path.abspath(__file__" \
                in text.replace(" ", ""):
            bad.append(mod)
    assert bad == []
