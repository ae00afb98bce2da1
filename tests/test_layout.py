"""The code's floors: which package may import which, where vLLM internals are read, file sizes.

Each package of `replicas/` runs in one place (the router, the replica actor, vLLM's worker
process) or is shared by several; an import across those lines drags code, and torch or vLLM,
into a process that has no business with them. The rules are read from the source (no import
runs), so a violation names the file and the line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600

# package folder -> the capserve modules its code may import (a name and everything below it)
ALLOWED: dict[str, tuple[str, ...]] = {
    # the contract: the router and the provider import it, so it stays free of everything else
    "replicas/api": ("replicas.api",),
    "replicas/plans": ("replicas.api", "replicas.plans"),
    "replicas/arena": ("replicas.api", "replicas.arena"),
    "replicas/sae": ("replicas.api", "replicas.plans", "replicas.sae"),
    "replicas/readouts": ("replicas.api", "replicas.plans", "replicas.readouts"),
    "replicas/readouts": ("replicas.api", "replicas.plans", "replicas.readouts"),
    "replicas/shards": ("replicas.api", "replicas.arena", "replicas.shards"),
    # vLLM's worker process: never the replica's engine, the deployment or the Serve layer; of the
    # engine package only the options it was started with
    "replicas/worker": ("replicas._vllm", "replicas.api", "replicas.plans", "replicas.arena", "replicas.sae",
                        "replicas.readouts", "replicas.worker", "replicas.engine.config"),
    "replicas/engine": ("replicas._vllm", "replicas.api", "replicas.plans", "replicas.arena", "replicas.sae",
                        "replicas.readouts", "replicas.engine"),
    # the Serve layer and the clients: never the worker, vLLM internals or the engine itself
    "deploy": ("deploy", "replicas.api", "replicas.plans", "replicas.shards", "replicas.replica", "replicas.engine.config"),
    "provider": ("provider", "replicas.api", "replicas.shards"),
}
NO_TORCH = ("replicas/api", "replicas/plans", "deploy", "provider")
# TransformerLens's bridge runs its own torch modules on the caller's side (the `tl` extra)
TORCH_ALLOWED = {ROOT / "provider" / "tl_bridge.py"}
# vLLM's public entry points; everything else of vLLM is read in the replicas/_vllm package alone
PUBLIC_VLLM = ("vllm", "vllm.inputs", "vllm.v1.engine.async_llm")
CHOKEPOINT = ROOT / "replicas" / "_vllm"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, in functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            # `from replicas import _vllm` imports the module replicas._vllm
            found += [(node.lineno, name if node.module in ("replicas", "deploy", "provider") else node.module) for name in names]
    return sorted(found)


def python_files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_package_imports_only_the_floors_it_may(folder: str):
    own = ("replicas", "deploy", "provider")
    crossings = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in python_files(folder)
        for line, module in imports(path)
        if within(module, own) and module not in own and not within(module, ALLOWED[folder])
    ]
    assert not crossings, "\n".join(crossings)


@pytest.mark.parametrize("folder", NO_TORCH)
def test_the_contract_the_router_and_the_clients_never_import_torch_or_vllm(folder: str):
    heavy = [f"{path.relative_to(ROOT)}:{line} imports {module}" for path in python_files(folder)
             if path not in TORCH_ALLOWED for line, module in imports(path) if within(module, ("torch", "vllm"))]
    assert not heavy, "\n".join(heavy)


def test_only_the_chokepoint_reads_vllm_internals():
    internal = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for folder in ("replicas", "deploy", "provider")
        for path in python_files(folder)
        if CHOKEPOINT not in path.parents
        for line, module in imports(path)
        if within(module, ("vllm",)) and module not in PUBLIC_VLLM
    ]
    assert not internal, "\n".join(internal) + "\n(move the access into replicas/_vllm/)"


def test_no_file_is_past_the_size_a_reader_takes_in():
    long = [f"{path.relative_to(ROOT)}: {n} lines" for folder in ("replicas", "deploy", "provider")
            for path in python_files(folder) if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, "\n".join(long)


def test_the_rules_catch_a_crossing(tmp_path: Path):
    """The reader sees imports inside functions and `from package import module` forms."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from replicas import _vllm\n    import vllm.v1.worker\nfrom replicas.engine import tokens\n")
    assert imports(path) == [(2, "replicas._vllm"), (3, "vllm.v1.worker"), (4, "replicas.engine")]
