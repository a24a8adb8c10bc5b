"""AdamW with decoupled weight decay on matrices only (not on norms, biases or, by default, embeddings),
and the optimizer half of muP / CompleteP: per-group learning-rate multipliers, epsilon and decay.

Each parameter has a role: `hidden` (the attention matrices and SwiGLU's w1, w3), `ffn_out`
(SwiGLU's w2), `head` (the untied LM head), `embedding`, `norm`. Under sp every role takes
optimizer.lr and optimizer.eps, as before. With m = dim / mup_base_dim, r = hidden_dim / the base's
(w2's fan-in multiplier: ModelArgs.ffn_width_mult) and m_L = n_layers / mup_base_layers (ModelArgs):

| role      | lr multiplier | eps          | weight decay        |
|-----------|---------------|--------------|---------------------|
| hidden    | 1/m           | eps/(m m_L)  | wd x m (lr x wd held) |
| ffn_out   | 1/r           | eps/(m m_L)  | wd x r              |
| head      | 1             | eps/m        | wd                  |
| embedding | 1             | eps/m        | wd if decay_embeddings, else 0 |
| norm      | 1             | eps/(m m_L)  | 0                   |

The rates and decays are microsoft/mup's MuAdam's (each matrix by its own fan-in ratio, which is
not m for w2 when `multiple_of` rounds the SwiGLU width; tests/test_mup.py compares them). The eps
follow the gradients: under muP every role's gradient shrinks as 1/m (the logits' 1/m multiplier
scales the whole backward pass; measured slopes -0.99 to -1.03), so an unscaled eps would swamp the
update of a wide model; CompleteP's reference (EleutherAI nanoGPT-mup) scales them so too. w2's
gradient shrinks as 1/m, not 1/r, so its eps is the hidden one. CompleteP (alpha = 1) divides the
eps of hidden matrices and norm gains by m_L as well; its learning rates do not depend on depth.
Roles with the same settings share a group. The multiplier is the group's `lr_scale`: the trainer
sets each group's rate to schedule(step) x lr_scale. ZeRO-3 flattens the parameters of a group into
one tensor, so the rules must live in the groups, not on tensors.
"""

from __future__ import annotations

import math
import re

import torch

from pretrain.config import OptimizerConfig
from pretrain.model.args import ModelArgs

ROLES = ("hidden", "ffn_out", "head", "embedding", "norm")


def role(name: str, ndim: int) -> str:
    if "tok_embeddings" in name:
        return "embedding"
    if ndim < 2 or re.search(r"\.experts\.b[123]$", name):  # (an MoE's expert biases, (E, ...), are vectors)
        return "norm"
    if name.startswith("output.") or ".output." in name:
        return "head"
    # (w2 of a dense block, of an MoE block's stacked experts and of its shared experts)
    return "ffn_out" if re.search(r"\.feed_forward\.(experts\.|shared\.)?w2(\.|$)", name) else "hidden"


def group_settings(args: ModelArgs, cfg: OptimizerConfig) -> dict[str, dict]:
    """role -> {"lr_scale", "eps", "weight_decay"} for this model and optimizer config."""
    m, r, m_depth = args.width_mult, args.ffn_width_mult, args.depth_mult
    wd, eps = cfg.weight_decay, cfg.eps
    out = {
        "hidden": {"lr_scale": 1.0, "eps": eps, "weight_decay": wd},
        "ffn_out": {"lr_scale": 1.0, "eps": eps, "weight_decay": wd},
        "head": {"lr_scale": 1.0, "eps": eps, "weight_decay": wd},
        "embedding": {"lr_scale": 1.0, "eps": eps, "weight_decay": wd if cfg.decay_embeddings else 0.0},
        "norm": {"lr_scale": 1.0, "eps": eps, "weight_decay": 0.0},
    }
    if args.parametrization != "sp":
        out["hidden"] = {"lr_scale": 1.0 / m, "eps": eps / (m * m_depth), "weight_decay": wd * m}
        out["ffn_out"] = {"lr_scale": 1.0 / r, "eps": eps / (m * m_depth), "weight_decay": wd * r}
        out["head"]["eps"] = out["embedding"]["eps"] = eps / m
        out["norm"]["eps"] = eps / (m * m_depth)
    return out


def param_groups(model: torch.nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """The optimizer's groups, in role order (ROLES), roles with equal settings merged; under sp two
    groups, decayed (matrices) and not decayed (1-D params, and embeddings unless
    cfg.decay_embeddings). Roles are decided by name and ndim, which ZeRO-3 keeps in `ds_shape` when
    a parameter is partitioned. Each group carries its `lr_scale`."""
    settings = group_settings(model.args, cfg)
    groups: list[dict] = []
    for r in ROLES:
        key = settings[r]
        found = next((g for g in groups if all(g[k] == v for k, v in key.items())), None)
        if found is None:
            groups.append(found := {"params": [], **key})
        found.setdefault("roles", []).append(r)
    by_role = {r: g for g in groups for r in g["roles"]}
    for name, p in model.named_parameters():
        if p.requires_grad:
            by_role[role(name, len(getattr(p, "ds_shape", p.shape)))]["params"].append(p)
    return [{k: v for k, v in g.items() if k != "roles"} for g in groups if g["params"]]


def expert_groups(groups: list[dict]) -> list[dict]:
    """`groups` with each one's experts, where expert parallelism runs at ZeRO-1/2 (parameters
    marked by pretrain/parallel/expert_parallel.py: `allreduce` False, `group_name`), moved into a
    group of their own with its settings, after all the others (a dense run's groups keep their
    places), marked as DeepSpeed wants its MoE groups ("moe", "name": the expert-parallel group),
    which it partitions and reduces over the ranks that hold the same experts. (DeepSpeed's
    deepspeed.moe.utils split needs a "name" on every group; this is its rule, written for ours.)"""
    dense, experts = [], []
    for g in groups:
        marked = [p for p in g["params"] if getattr(p, "allreduce", True) is False]
        rest = [p for p in g["params"] if getattr(p, "allreduce", True) is not False]
        if rest:
            dense.append({**g, "params": rest})
        for name in dict.fromkeys(p.group_name for p in marked):
            experts.append({**g, "params": [p for p in marked if p.group_name == name], "moe": True, "name": name})
    return dense + experts


def set_lr(optimizer, lr: float) -> None:
    """Give each group the rate `lr` x its `lr_scale` (groups restored from checkpoints written before
    groups had one are sp's: 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


MUON_ROLES = ("hidden", "ffn_out")  # the 2-D hidden matrices: wq wk wv wo w1 w3, and w2


def muon_lr_scale(shape, base_shape=None) -> float:
    """Muon's rate for a (fan_out, fan_in) matrix relative to optimizer.lr (the match_adamw rule).

    sp (no base_shape): Moonshot's rule (torch.optim.Muon's adjust_lr_fn="match_rms_adamw") steps
    the orthogonalised update O by lr x 0.2 sqrt(max(fan_out, fan_in)), which gives it the RMS of a
    typical AdamW update (about 0.2), so AdamW's rate and decay carry over. DeepSpeed's muon_update
    already scales O by sqrt(max(1, fan_out / fan_in)) (Keller Jordan's original rule), so the
    group's rate carries the ratio of the two: 0.2 sqrt(fan_in) for either aspect.

    mup/completep (base_shape: the matrix's shape in the base model): Moonshot's rule at the base
    shape, then the spectral condition (Yang, Simon, Bernstein 2023) across width: O has spectral
    norm ~1 at any width, and a hidden matrix's update must have spectral norm ~ sqrt(fan_out /
    fan_in) for its features to move by O(1), so the step is
    lr x 0.2 sqrt(max(base)) x sqrt(aspect / base aspect): width-independent where the aspect is
    (every matrix of a family grown at fixed ratios), never the 0.2 sqrt(fan_in) of sp, which grows
    as sqrt(m). Less DeepSpeed's factor, the rate is 0.2 sqrt(base fan_in x min(1, aspect) /
    min(1, base aspect)): the tall w1, w3 take their change of aspect (r/m under `multiple_of`
    rounding) from DeepSpeed's factor, the wide w2 from the last factor, sqrt(m/r). The update is
    scale-free, so the 1/m_L that CompleteP puts on each branch's gradient does not reach it: no
    depth factor, as AdamW's rates under CompleteP (alpha = 1) have none. At the base shape the rule
    is sp's, so one base rate serves both."""
    fan_out, fan_in = shape
    base_out, base_in = base_shape or shape
    return 0.2 * math.sqrt(base_in * min(1, fan_out / fan_in) / min(1, base_out / base_in))


def base_shape(name: str, shape, args: ModelArgs):
    """A hidden matrix's shape in the mup/completep base model (None under sp): each side divided
    by its width multiplier, r for the SwiGLU width (w1, w3 out, w2 in), m for the rest."""
    if args.parametrization == "sp":
        return None
    m, r = args.width_mult, args.ffn_width_mult
    if ".feed_forward.w2." in name:
        return shape[0] / m, shape[1] / r
    if ".feed_forward.w1." in name or ".feed_forward.w3." in name:
        return shape[0] / r, shape[1] / m
    return shape[0] / m, shape[1] / m


def muon_param_groups(model: torch.nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """AdamW's groups (param_groups) with the hidden roles' matrices (an MoE layer's stacked experts:
    each expert's) moved to Muon groups, one per
    rate (muon_lr_scale: by fan-in under sp, by the base's under mup/completep); every group is
    tagged `use_muon`, and so is every parameter, which is how ZeRO finds the matrices it must
    orthogonalise (by role, not by DeepSpeed's own name rule, which would hand our untied `output`
    head to Muon). The decay is divided by the rate's scale so that each step decays by
    optimizer.lr x weight_decay (AdamW's product, held under muP too), as torch.optim.Muon and
    Moonshot do."""
    names = {p: n for n, p in model.named_parameters()}
    groups = []
    muon: dict[float, dict] = {}
    for g in param_groups(model, cfg):
        rest = []
        for p in g["params"]:
            shape = getattr(p, "ds_shape", p.shape)
            # An MoE layer's stacked experts (E, out, in) are E matrices: DeepSpeed's muon_update
            # orthogonalises each one apart (a batched Newton-Schulz) where `is_expert_group` says so.
            p.use_muon = len(shape) in (2, 3) and role(names[p], len(shape)) in MUON_ROLES
            if not p.use_muon:
                rest.append(p)
                continue
            p.is_expert_group = len(shape) == 3
            shape = shape[-2:]
            scale = muon_lr_scale(shape, base_shape(names[p], shape, model.args))
            if scale not in muon:
                muon[scale] = {"params": [], "use_muon": True, "lr_scale": scale, "lr": cfg.lr * scale,
                               "weight_decay": g["weight_decay"] * g["lr_scale"] / scale,
                               "momentum": cfg.muon_momentum, "ns_method": cfg.muon_ns_method}
            muon[scale]["params"].append(p)
        if rest:
            groups.append({**g, "params": rest, "use_muon": False, "lr": cfg.lr * g["lr_scale"],
                           "betas": (cfg.beta1, cfg.beta2)})
    return groups + list(muon.values())


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    # torch's AdamW rather than DeepSpeed's FusedAdam/CPUAdam: no op build at start-up, and it resumes
    # bitwise (FusedAdam drifted ~5e-7 after a load when we measured it); fused on CUDA for speed.
    if cfg.name == "muon":
        # DeepSpeed's class, not torch.optim.Muon: ZeRO recognises it (isinstance) and runs the
        # Newton-Schulz step on full gradients it gathers itself; torch's AdamW does the rest.
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

        return MuonWithAuxAdam(muon_param_groups(model, cfg), adam_optimizer=torch.optim.AdamW,
                               adam_optimizer_kwargs={"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps,
                                                      "fused": device.type == "cuda"})
    return torch.optim.AdamW(expert_groups(param_groups(model, cfg)), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=device.type == "cuda")
