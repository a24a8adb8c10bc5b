"""The architecture as the imports draw it (ast, not a regex): no import circle in pretrain/ or
data_pipeline/ (an import inside a function counts: it ties the modules as surely), and the model
package free of the distributed runtime and of the data pipeline; and every collective called in one
module, pretrain/parallel/distributed.py."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pretrain", "data_pipeline")
# What pretrain/model/ may not import: the distributed runtime, and the data pipeline (the model takes
# tensors; document boundaries come from data_pipeline.document_inputs, which its callers use).
RUNTIME = ("deepspeed", "accelerate", "torch.distributed")
NOT_IN_MODEL = (*RUNTIME, "data_pipeline", "transformers")  # (the HF mapping lives in pretrain/hf/)
# pretrain's layers, lowest first: a module imports from its own layer or lower ones (the longest
# prefix names a module's layer). The cost model (estimate) and the HF mapping read only config and
# the model; the layout and its collectives (parallel.distributed) are the floor of the runtime;
# the engine (parallel.parallelize) is built on the optimizers; checkpoints on the engine's layout;
# export, evaluation and the trainer on checkpoints; the entry points on everything.
LAYERS = [
    ("pretrain.errors", "pretrain.model"),
    ("pretrain.config", "pretrain.plot"),
    ("pretrain.estimate", "pretrain.hf.mapping"),
    ("pretrain.parallel.distributed", "pretrain.parallel.traffic", "pretrain.checkpoint.rundir", "pretrain.hf.hub",
     "pretrain.faults.inject"),
    ("pretrain.optim", "pretrain.parallel.ulysses", "pretrain.parallel.expert_parallel", "pretrain.checkpoint.states",
     "pretrain.checkpoint.layout", "pretrain.faults.watchdog", "pretrain.faults.stragglers", "pretrain.metrics"),
    ("pretrain.parallel.parallelize",),
    ("pretrain.checkpoint", "pretrain.faults.spikes"),
    ("pretrain.hf.export", "pretrain.eval"),
    ("pretrain.build", "pretrain.trainer", "pretrain.scaling", "pretrain.mup"),
    ("pretrain.train", "pretrain.cli", "pretrain.__main__", "pretrain"),
]


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
    importing the watchdog's timings from faults.watchdog, which imports config) is found."""
    import shutil

    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    config = tmp_path / "pretrain" / "config.py"
    config.write_text(config.read_text() + "\n\ndef _timings():\n    from pretrain.faults.watchdog import HANG_EXIT_S\n\n"
                      "    return HANG_EXIT_S\n")
    found = cycles(graph(tmp_path))
    assert any({"pretrain.config", "pretrain.faults.watchdog"} <= set(c) for c in found), found


def layer(name: str) -> int | None:
    """The index in LAYERS of a pretrain module's layer (its longest listed prefix), None if unlisted."""
    best = None
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (i, prefix)
    return best and best[0]


def upward(g: dict[str, set[str]]) -> list[str]:
    """Imports that run up a layer; modules no layer lists; data_pipeline importing pretrain."""
    out = []
    for name, targets in sorted(g.items()):
        if name.startswith("data_pipeline"):
            out += [f"{name} imports {t} (the data pipeline stands below pretrain)" for t in targets
                    if t.startswith("pretrain")]
            continue
        if layer(name) is None:
            out.append(f"{name} is in no layer of LAYERS")
            continue
        out += [f"{name} (layer {layer(name)}) imports {t} (layer {layer(t)})" for t in sorted(targets)
                if t.startswith("pretrain") and layer(t) is not None and layer(t) > layer(name)]
    return out


def test_no_import_runs_up_a_layer():
    assert not upward(graph()), upward(graph())


def test_the_layer_check_finds_an_import_up(tmp_path):
    """Not vacuous: the cost model reading the runtime (estimate importing parallel's engine), and the
    optimizer reading the trainer, are found."""
    import shutil

    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    for f, target in (("estimate/memory.py", "pretrain.parallel.parallelize"), ("optim/schedule.py", "pretrain.trainer")):
        path = tmp_path / "pretrain" / f
        path.write_text(path.read_text() + f"\n\ndef _up():\n    import {target}  # noqa: F401\n")
    found = upward(graph(tmp_path))
    assert any("pretrain.estimate.memory (layer 2) imports pretrain.parallel.parallelize" in x for x in found), found
    assert any("pretrain.optim.schedule (layer 4) imports pretrain.trainer" in x for x in found), found


def test_the_model_imports_no_distributed_runtime_and_no_data_pipeline():
    """pretrain/model/ is a plain decoder: torch, never DeepSpeed, accelerate or torch.distributed
    (sequence parallelism wraps it from pretrain/parallel/ulysses.py), nor the data pipeline (it takes
    token ids, positions and document ids), nor transformers (the mapping: pretrain/hf/mapping.py)."""
    bad = []
    for name, f in modules().items():
        if name.startswith("pretrain.model"):
            for target, line in imported(name, f, ast.parse(f.read_text())):
                if any(target == r or target.startswith(r + ".") for r in NOT_IN_MODEL):
                    bad.append(f"{f.relative_to(REPO)}:{line} imports {target}")
    assert not bad, bad


COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
               "monitored_barrier", "send", "recv", "isend", "irecv"}


COMM = ("torch.distributed", "deepspeed.comm")  # (DeepSpeed's wraps torch's: a call through it is one too)


def _direct_collectives(path: Path) -> list[str]:
    """Calls of torch.distributed or deepspeed.comm collectives in a file: `dist.X(...)` where dist is
    an alias of either, `torch.distributed.X(...)`, or X imported from either."""
    tree = ast.parse(path.read_text())
    aliases, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name in COMM}
        elif isinstance(node, ast.ImportFrom) and node.module in COMM:
            names |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "deepspeed"):
            aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in COMM}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in names:
            found.append(f"{path.name}:{node.lineno} {f.id}")
        elif isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            owner = ast.unparse(f.value)
            if owner in aliases or owner in COMM:
                found.append(f"{path.name}:{node.lineno} {owner}.{f.attr}")
    return found


def test_no_module_but_distributed_calls_a_collective():
    """Every collective is called in pretrain/parallel/distributed.py, where its tensors and groups are
    checked (host values over gloo, device tensors over the default group), and nowhere else: not
    in the rest of the parallel wing, nor in optim/ (Muon's all-to-alls), nor in bench/."""
    files = [p for d in ("pretrain", "data_pipeline", "bench") for p in (REPO / d).rglob("*.py")]
    owner = REPO / "pretrain" / "parallel" / "distributed.py"
    assert owner in files and _direct_collectives(owner), "the scan finds nothing: it is broken"
    offenders = [hit for p in files if p != owner for hit in _direct_collectives(p)]
    assert offenders == [], offenders


def test_the_scan_sees_every_spelling(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch.distributed as dist\nimport torch\nfrom torch.distributed import broadcast\n"
                      "from torch import distributed as d2\nimport deepspeed.comm as dcomm\n"
                      "from deepspeed.comm import all_to_all_single\n"
                      "dist.all_reduce(x)\ntorch.distributed.barrier()\nbroadcast(t, 0)\nd2.all_gather_object(o, x)\n"
                      "dcomm.all_gather(o, x)\nall_to_all_single(o, x)\ndist.get_rank()\n")
    assert len(_direct_collectives(sample)) == 6
