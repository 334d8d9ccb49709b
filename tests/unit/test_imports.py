"""The package layout's rules, read from the source with `ast` (nothing is imported):

- no import cycles between the project's modules (the local cluster's `e2e`, the tests and
  the benchmarks included), and no private name (`_x`) imported from another module;
- the contract, the operator and the sync agent never import torch (directly or through
  another project module), so the operator image and the sync-agent sidecar stay slim;
- the contract imports no kopf, and no deployable's package imports another's except
  through the contract (the trainer image's packages may use `rft_trainer.experience`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"rft_contract": ROOT / "contract", "rft_operator": ROOT / "operator",
            "rft_trainer": ROOT / "trainer_image", "rft_rollout": ROOT / "trainer_image",
            "rft_serving": ROOT / "trainer_image", "e2e": ROOT, "tests": ROOT, "bench": ROOT}
SLIM = ("rft_contract", "rft_operator", "rft_serving.sync_agent")


def module_files() -> dict[str, Path]:
    out = {}
    for pkg, base in PACKAGES.items():
        for path in sorted((base / pkg).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """Every module `name` imports, anywhere in the file (lazy imports count too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from . import x`
    return found


def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path) for name, path in files.items()}


def project_edges(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """Project-internal edges; importing `a.b.c` also runs the packages `a` and `a.b`."""
    def with_parents(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}

    return {m: {p for i in deps for p in with_parents(i) if p in g and p != m and not m.startswith(p + ".")}
            for m, deps in g.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def closure(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every project module that importing `start` runs, its own parent packages included
    (`import a.b.c` runs a/__init__.py and a/b/__init__.py first)."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            parts = m.split(".")
            todo += [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in edges]
            todo += edges[m]
    return seen


def test_the_walk_sees_every_package():
    g = graph()
    assert {"rft_contract.spec", "rft_operator.handlers", "rft_trainer.trainer",
            "rft_rollout.explorer", "rft_serving.sync_agent"} <= set(g)
    assert "rft_contract.spec" in project_edges(g)["rft_operator.crdgen"]


def test_no_import_cycles():
    cycle = find_cycle(project_edges(graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("root", SLIM)
def test_slim_deployables_never_import_torch(root):
    g = graph()
    edges = project_edges(g)
    starts = [m for m in g if m == root or m.startswith(root + ".")]
    for start in starts:
        for m in closure(edges, start):
            heavy = {i for i in g[m] if i.split(".")[0] in ("torch", "transformers", "safetensors")}
            assert not heavy, f"{start} reaches {m}, which imports {sorted(heavy)}"


def test_contract_imports_no_operator_framework_and_no_deployable():
    g = graph()
    for m in (m for m in g if m.startswith("rft_contract")):
        bad = {i for i in g[m] if i.split(".")[0] in ("kopf", "rft_operator", "rft_trainer",
                                                    "rft_rollout", "rft_serving")}
        assert not bad, f"{m} imports {sorted(bad)}"


ALLOWED = {  # package -> the other deployables' modules it may import
    "rft_operator": set(),
    "rft_serving": set(),
    # spec.evaluation: rank 0 scores versions with the explorer's client, prompts and rewards
    "rft_trainer": {"rft_rollout.evaluator"},
    "rft_rollout": {"rft_trainer", "rft_trainer.experience",  # the shard format
                    "rft_trainer.tracking"},  # spec.tracking: the explorers log to the same trackers
}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_deployables_meet_only_through_the_contract(package):
    g = graph()
    others = {p for p in ALLOWED if p != package}
    for m in (m for m in g if m.split(".")[0] == package):
        bad = {i for i in g[m] if i in g and i.split(".")[0] in others and i not in ALLOWED[package]}
        assert not bad, f"{m} imports {sorted(bad)}"


def test_a_package_init_that_imports_torch_taints_its_modules():
    """The walk follows parent packages: sync_agent would run rft_serving/__init__.py."""
    edges = {"p": {"p.heavy"}, "p.heavy": set(), "p.light": set()}
    assert "p.heavy" in closure(edges, "p.light")


def test_operator_uses_only_the_contract():
    g = graph()
    for m in (m for m in g if m.startswith("rft_operator")):
        bad = {i for i in g[m] if i.split(".")[0] in ("rft_trainer", "rft_rollout", "rft_serving")}
        assert not bad, f"{m} imports {sorted(bad)}"


def test_no_private_name_is_imported_from_another_module():
    """A leading underscore says "this module's own": another module that needs it should
    get it under a public name (or from a module both can import)."""
    files = module_files()
    bad = []
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] not in PACKAGES:
                    continue
                bad += [f"{path.relative_to(ROOT)}: from {base} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "\n".join(bad)


def test_the_engine_helpers_import_only_the_standard_library_and_each_other():
    """supervise.py and cpu_isa.py run in any engine image (the init container copies them
    there, rft_serving.sync_agent.HELPER_FILES): nothing but the standard library, the
    other helpers and, in vllm_worker.py, the engine's own packages."""
    import sys

    from rft_serving.sync_agent import HELPER_FILES

    files = module_files()
    helpers = {"rft_serving" + ("" if f == "__init__.py" else "." + f[:-3]) for f in HELPER_FILES}
    assert "rft_serving.cpu_isa" in helpers and "rft_serving.supervise" in helpers
    allowed = helpers | {"__future__"}
    for name in helpers:
        # safetensors: vLLM's own dependency (vllm_worker reads an adapter file apart from its loader)
        engine = {"vllm", "torch", "safetensors"} if name == "rft_serving.vllm_worker" else set()
        for imported in imports_of(name, files[name]):
            top = imported.split(".")[0]
            assert imported in allowed or top in sys.stdlib_module_names or top in engine or (
                imported.rpartition(".")[0] in helpers), f"{name} imports {imported}"
