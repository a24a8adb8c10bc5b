"""The architecture as the imports draw it (ast, not a regex): no import circle in pretrain/ or
data_pipeline/ (an import inside a function counts: it ties the modules as surely), and the model
package free of the distributed runtime. (That every collective is called in pretrain/distributed.py:
tests/test_distributed.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pretrain", "data_pipeline")
# What pretrain/model/ may not import: the distributed runtime, and the data pipeline (the model takes
# tensors; document boundaries come from data_pipeline.document_inputs, which its callers use).
RUNTIME = ("deepspeed", "accelerate", "torch.distributed")
NOT_IN_MODEL = (*RUNTIME, "data_pipeline")


def modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the packages: dotted name -> file."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imported(name: str, f: Path, tree: ast.Module) -> list[tuple[str, int]]:
    """(module imported, line) for every import in the file, relative ones resolved; `from P import m`
    names the submodule P.m where it is one (the caller tells)."""
    package = name if f.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names] + [(base, node.lineno)]
    return out


def graph(root: Path = REPO) -> dict[str, set[str]]:
    """module -> the package modules it imports (a package's __init__ only where it is named itself)."""
    mods = modules(root)
    out: dict[str, set[str]] = {}
    for name, f in mods.items():
        edges = set()
        targets = imported(name, f, ast.parse(f.read_text()))
        named = {t for t, _ in targets}
        for target, _ in targets:
            if target in mods:
                # `from P import m` lists P too: count P only if no P.m submodule was what it named
                if any(t.startswith(target + ".") and t in mods for t in named) and target != name:
                    continue
                edges.add(target)
            else:  # an attribute of a module: the module
                head = target.rpartition(".")[0]
                if head in mods:
                    edges.add(head)
        edges.discard(name)
        out[name] = edges
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
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
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_check_finds_a_circle_put_back(tmp_path):
    """The check is not vacuous: today's tree with one of the circles it had put back (config
    importing the watchdog's timings from resilience, which reaches config again through checkpoint
    and parallelize) is found."""
    import shutil

    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    config = tmp_path / "pretrain" / "config.py"
    config.write_text(config.read_text() + "\n\ndef _timings():\n    from pretrain.resilience import HANG_EXIT_S\n\n"
                      "    return HANG_EXIT_S\n")
    found = cycles(graph(tmp_path))
    assert any({"pretrain.config", "pretrain.resilience"} <= set(c) for c in found), found


def test_the_model_imports_no_distributed_runtime_and_no_data_pipeline():
    """pretrain/model/ is a plain decoder: torch (and transformers for the HF mapping), never
    DeepSpeed, accelerate or torch.distributed (sequence parallelism wraps it from pretrain/ulysses.py),
    nor the data pipeline (it takes token ids, positions and document ids)."""
    bad = []
    for name, f in modules().items():
        if name.startswith("pretrain.model"):
            for target, line in imported(name, f, ast.parse(f.read_text())):
                if any(target == r or target.startswith(r + ".") for r in NOT_IN_MODEL):
                    bad.append(f"{f.relative_to(REPO)}:{line} imports {target}")
    assert not bad, bad
