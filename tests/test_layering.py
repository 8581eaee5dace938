"""Dependencies point one way: kernels <- model adapters and patching <- generation, scoring,
engine <- server and distributed jobs <- CLIs, with benchmarks on top. Every import counts,
function-level ones too (they must not hide a cycle); a package's ``__init__`` re-exports count as
imports of its modules."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"invariant_infer": ROOT / "invariant_infer", "benchmarks": ROOT / "benchmarks"}

# Lower layers never import higher ones. Each entry is a folder (``.*``: the package and everything
# in it) or one module; a module belongs to its most specific entry, so a subfolder can sit a layer
# above its parent, and a new folder fails the test until it is placed.
LAYERS = [
    ["invariant_infer.kernels.*"],
    ["invariant_infer.errors", "invariant_infer.model.*"],
    ["invariant_infer.checkpoints.*", "invariant_infer.testing.*", "invariant_infer.generation.*",
     "invariant_infer.scoring.*", "invariant_infer.engine.*", "invariant_infer.training.*", "invariant_infer"],
    ["invariant_infer.server.*", "invariant_infer.parallel.*", "invariant_infer.scoring.job.*",
     "invariant_infer.training.integrations.*"],
    ["invariant_infer.cli.*"],
    ["benchmarks.*"],
]
# Cycles a package's registration needs: families/__init__ imports each family module, which
# registers itself with the package.
ALLOWED_CYCLE_EDGES = {(f"invariant_infer.model.families.{name}", "invariant_infer.model.families")
                       for name in ("deepseek_v3", "gemma3", "gemma4", "gemma4_multimodal", "glm4_moe", "gpt_oss",
                                    "llama", "mistral", "mixtral", "qwen2", "qwen2_5_vl", "qwen2_moe", "qwen3",
                                    "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_next")}


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


MODULES = module_files()


def imports_of(name: str, path: Path) -> set[str]:
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:  # `from pkg import module` imports the module, else pkg's name
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def layer_of(module: str) -> int:
    matches = []
    for rank, entries in enumerate(LAYERS):
        for entry in entries:
            package = entry.removesuffix(".*")
            if module == package or (entry.endswith(".*") and module.startswith(package + ".")):
                matches.append((len(package), rank))
    if not matches:
        raise AssertionError(f"{module} is in no layer of tests/test_layering.py: add it where it belongs")
    return max(matches)[1]


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_import(module):
    upward = sorted(m for m in GRAPH[module] if layer_of(m) > layer_of(module))
    assert not upward, f"{module} (layer {layer_of(module)}) imports higher layers: {upward}"


def test_kernels_know_nothing_of_transformers_or_the_library():
    for module, path in MODULES.items():
        if not module.startswith("invariant_infer.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for imported in names:
                top = imported.split(".")[0]
                assert top not in ("transformers", "invariant_infer", "kernels"), f"{module} imports {imported}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def without_allowed_edges(graph):
    return {m: {d for d in deps if (m, d) not in ALLOWED_CYCLE_EDGES} for m, deps in graph.items()}


def test_no_import_cycles():
    cycle = find_cycle(without_allowed_edges(GRAPH))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_negative_control_a_cycle_and_an_upward_import_are_found():
    graph = without_allowed_edges({**GRAPH, "invariant_infer.scoring.core": GRAPH["invariant_infer.scoring.core"]
                                   | {"invariant_infer.cli.score"}})
    assert find_cycle(graph) is not None
    assert layer_of("invariant_infer.cli.score") > layer_of("invariant_infer.scoring.core")
    # Through a package's __init__: a module it re-exports importing the package back.
    graph = without_allowed_edges({**GRAPH, "invariant_infer.generation.generate": GRAPH["invariant_infer.generation.generate"]
                                   | {"invariant_infer"}})
    assert find_cycle(graph) is not None
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("invariant_infer.brand_new_module")


def test_the_library_never_imports_tests():
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert not any(n.split(".")[0] in ("tests", "helpers", "conftest") for n in names), module


def test_every_subpackage_ships():
    """A non-editable install gets only the packages pyproject.toml lists."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1)))
    present = {name for name, path in MODULES.items()
               if path.name == "__init__.py" and name.startswith("invariant_infer")}
    assert present == listed, f"missing from pyproject.toml: {sorted(present - listed)}"


# ---- one reader of transformers' private TP size; no executor found through the model ----------

TP_SIZE_READER = ("invariant_infer.model.tensor_parallel", "tp_size_of")


def private_tp_size_reads(tree: ast.AST, module: str) -> list[tuple[str, str]]:
    """(module, enclosing function) of each ``_tp_size`` attribute or string in ``tree``."""
    found = []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if (isinstance(node, ast.Attribute) and node.attr == "_tp_size") or \
                (isinstance(node, ast.Constant) and isinstance(node.value, str) and "_tp_size" in node.value):
            found.append((module, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)
    visit(tree, "<module>")
    return found


def executor_lookups(tree: ast.AST) -> list[str]:
    """Where an object attaches itself to another (``x.attr = self``, ``setattr(x, name, self)``, as a
    driver setting itself on a model would), and where code looks something up on a model by a
    name that names an executor (``getattr(model, MIRROR_ATTR)``, ``model._executor``)."""
    def model_like(node) -> bool:
        text = ast.unparse(node)
        return "model" in text.split(".")[-1] or text.endswith("model")

    def names_an_executor(text: str) -> bool:
        return any(word in text.lower() for word in ("executor", "mirror", "ranks"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == "self":
            found += [ast.unparse(t) for t in node.targets
                      if isinstance(t, ast.Attribute) and ast.unparse(t.value) != "self"]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            target, name = node.args[0], node.args[1]
            if node.func.id == "setattr" and len(node.args) == 3 and ast.unparse(node.args[2]) == "self":
                found.append(ast.unparse(node))
            elif node.func.id in ("getattr", "hasattr", "setattr") and model_like(target) and \
                    names_an_executor(str(name.value) if isinstance(name, ast.Constant) else ast.unparse(name)):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Attribute) and model_like(node.value) and names_an_executor(node.attr):
            found.append(ast.unparse(node))
    return sorted(set(found))


def library_trees():
    for module, path in MODULES.items():
        if module.startswith("invariant_infer"):
            yield module, ast.parse(path.read_text())


def test_only_one_helper_reads_the_private_tp_size():
    reads = {read for module, tree in library_trees() for read in private_tp_size_reads(tree, module)}
    assert reads == {TP_SIZE_READER}


def test_nothing_looks_an_executor_up_on_the_model():
    found = {module: lookups for module, tree in library_trees() if (lookups := executor_lookups(tree))}
    assert not found, f"executors are passed in (executor=), never found through the model: {found}"


def test_negative_control_the_checks_see_a_rank_mirror_on_the_model():
    """The way rank 0's driver was once found: set on the model, looked up by attribute."""
    old = ast.parse("def rank_mirror(model):\n    return getattr(model, RANK_MIRROR_ATTR, None)\n"
                    "class Ranks:\n    def start(self):\n        setattr(self.model, RANK_MIRROR_ATTR, self)\n"
                    "        self.model._executor = self\n"
                    "def size(model):\n    return model.executor.tensor_parallel_size\n")
    assert executor_lookups(old) == ["getattr(model, RANK_MIRROR_ATTR, None)", "model.executor",
                                             "self.model._executor", "setattr(self.model, RANK_MIRROR_ATTR, self)"]
    second = ast.parse("def engine(model):\n    return getattr(model, '_tp_size', None) or 1\n")
    assert private_tp_size_reads(second, "engine") == [("engine", "engine")]
