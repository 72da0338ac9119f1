"""The module import graph of flashdist: no cycle, and every import points down the layer order.

Imports inside functions count too: a lazy import still ties the two modules together. Run as a script
(``python tests/test_structure.py``) to print every problem found.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flashdist"

# Top to bottom. A module may import modules of its own layer or of any layer below it, never above.
LAYERS = [
    ("flashdist", "flashdist.cli", "flashdist.integrations"),
    ("flashdist.checkpoint", "flashdist.gradient_release", "flashdist.memory", "flashdist.memory_plan"),
    ("flashdist.optim",),
    ("flashdist.functional",),
    ("flashdist.kernels",),
    ("flashdist.quant",),
]
# Utilities anyone may import; they import no other flashdist module themselves.
LEAVES = ("flashdist.distributed", "flashdist._compat", "flashdist.errors")


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The flashdist modules that module ``name`` imports anywhere in its body (functions included)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from package import module`` imports that module; ``from module import name`` the module
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import flashdist.x.y`` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def _within(module: str, prefix: str) -> bool:
    # the package itself ("flashdist") names its __init__ only: a new module must be given a layer
    return module == prefix or ("." in prefix and module.startswith(prefix + "."))


def layer_of(module: str) -> int | None:
    """Index in LAYERS (0 = top), or None for a leaf utility. The longest matching prefix decides."""
    best, index = "", None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if _within(module, prefix) and len(prefix) > len(best):
                best, index = prefix, i
    for prefix in LEAVES:
        if _within(module, prefix) and len(prefix) > len(best):
            best, index = prefix, None
    if not best:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS or LEAVES in tests/test_structure.py")
    return index


def _leaf_of(module: str) -> str | None:
    return next((prefix for prefix in LEAVES if _within(module, prefix)), None)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if mine is None:
                if _leaf_of(module) != _leaf_of(target):  # a leaf package's modules may use each other
                    problems.append(f"{module} (a leaf utility) imports {target}")
            elif theirs is not None and theirs < mine:
                problems.append(f"{module} (layer {mine}) imports {target} (layer {theirs}, above it)")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)  # raises for a module in no layer


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_upward_import():
    assert upward_imports(import_graph()) == []


def test_moved_names_keep_their_old_import_paths():
    """Names that moved down a layer are still importable where they were (the same objects)."""
    from flashdist.checkpoint import state as old_state
    from flashdist.kernels import scalars
    from flashdist.optim import base, params, state_dict
    from flashdist.quant import codes, moment

    for name in ("FORMATS", "FORMAT_VERSION", "LAYOUT_KEYS", "export_state_dict", "load_state_dict",
                 "quantize_moment", "dequantize_moment"):
        assert getattr(old_state, name) is getattr(state_dict, name), name
    assert base.state_layout is moment.state_layout and base.param_name is params.param_name
    assert scalars.f32 is codes.f32


def test_optimizer_base_is_split_by_responsibility():
    """FlashOptimizer's state lifecycle, outside-write tracking and state-dict methods live in their own modules
    (mixins), and base.py keeps construction, queries and the step within a few screens."""
    from flashdist.optim import base, lifecycle, outside_writes, state_io

    cls = base.FlashOptimizer
    for owner, names in ((lifecycle.StateLifecycle, ("sync_state", "ensure_state", "_init_state", "_forget")),
                         (outside_writes.OutsideWrites, ("adopt_outside_writes", "_reset_written_outside")),
                         (state_io.StateIO, ("state_dict", "load_state_dict", "state_dict_format_override",
                                             "__getstate__", "__setstate__"))):
        for name in names:
            assert getattr(cls, name) is getattr(owner, name), name
    assert len(module_files()["flashdist.optim.base"].read_text().splitlines()) < 500


def test_split_checkpoint_modules_keep_their_old_import_paths():
    """checkpoint/dcp.py and checkpoint/convert.py were split by responsibility: every public name they had is
    still importable from them (the same objects), and each lives in the one module that owns its job."""
    from flashdist.checkpoint import convert, dcp, dcp_files, errors, publish, sources

    moved = {dcp: {dcp_files: ("SafeFileSystemReader", "SafeLoadPlanner", "verify_shard", "shard_writer"),
                   errors: ("CheckpointError", "CheckpointWriteError", "error_summary"),
                   publish: ("resolve",)},
             convert: {sources: ("KINDS", "Progress", "Source", "dcp_entries", "detect", "open_source", "read",
                                 "read_dcp")}}
    for old, homes in moved.items():
        for home, names in homes.items():
            for name in names:
                assert name in old.__all__ and getattr(old, name) is getattr(home, name), (old.__name__, name)
                obj = getattr(home, name)
                if isinstance(obj, type) or inspect.isfunction(obj):  # defined there, not re-exported from elsewhere
                    assert obj.__module__ == home.__name__, name


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function, relative to a package, is an edge, and a cycle and an
    upward edge through it are reported (a checker that saw nothing would pass the tests above)."""
    root = tmp_path / "flashdist"
    for sub in ("optim", "quant", "kernels"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "quant" / "codes.py").write_text("def f():\n    from ..optim import base\n")
    (root / "optim" / "base.py").write_text("from ..quant import codes\n")
    (root / "kernels" / "scalars.py").write_text("import flashdist.quant.codes\n")
    modules = module_files(root)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["flashdist.quant.codes"] == {"flashdist.optim.base"}
    assert graph["flashdist.kernels.scalars"] == {"flashdist.quant.codes"}
    assert cycles(graph) == [["flashdist.optim.base", "flashdist.quant.codes"]]
    assert upward_imports(graph) == ["flashdist.quant.codes (layer 5) imports flashdist.optim.base (layer 2, above it)"]
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("flashdist.new_module")


if __name__ == "__main__":
    graph = import_graph()
    for problem in [" <-> ".join(c) for c in cycles(graph)] + upward_imports(graph):
        print(problem)
