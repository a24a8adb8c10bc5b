"""Metric loggers (one rank logs) and the throughput/MFU/memory figures they record.

Loggers are pluggable: `MetricLogger` is the no-op base, `JsonlLogger` always writes
run_dir/metrics.jsonl, `WandbLogger` imports wandb only when used. Scaling-law fields: every
training record carries tokens seen (D) and cumulative FLOPs (C); the run config carries total and
non-embedding parameter counts (N), so runs of different sizes compare directly against tokens or
compute. `attention_logit_maxima`: each layer's largest attention logit in a forward (logging.attn_logits).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from pretrain.model.attention import Attention

log = logging.getLogger(__name__)


def _dense(half: float, fp32: float) -> dict[str, float]:
    return {"bf16": half, "fp16": half, "fp32": fp32}


# Dense peak FLOP/s (no sparsity; datasheets quote tensor-core rates with 2:4 sparsity, twice these)
# per device, keyed by the exact name torch.cuda.get_device_name() reports: variants of one part
# differ (an H100 PCIe is 756 TFLOPS, an SXM 989). fp32 is the plain FP32 rate, not TF32: the trainer
# leaves TF32 off.
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": _dense(989.4e12, 67e12),  # SXM5
    "NVIDIA H100 PCIe": _dense(756e12, 51e12),
    "NVIDIA H100 NVL": _dense(835e12, 60e12),
    "NVIDIA H200": _dense(989.4e12, 67e12),  # SXM
    "NVIDIA H200 NVL": _dense(835e12, 60e12),
    "NVIDIA GH200 480GB": _dense(989.4e12, 67e12),
    "NVIDIA GH200 144G HBM3e": _dense(989.4e12, 67e12),
    "NVIDIA A100-SXM4-80GB": _dense(312e12, 19.5e12),
    "NVIDIA A100-SXM4-40GB": _dense(312e12, 19.5e12),
    "NVIDIA A100 80GB PCIe": _dense(312e12, 19.5e12),
    "NVIDIA A100-PCIE-40GB": _dense(312e12, 19.5e12),
    "NVIDIA L40S": _dense(362e12, 91.6e12),
    "NVIDIA A10": _dense(125e12, 31.2e12),
    "NVIDIA B200": {"bf16": 2250e12, "fp16": 2250e12},
    "Tesla V100-SXM2-16GB": {"fp16": 125e12, "fp32": 15.7e12},  # no bf16 units
    "Tesla V100-SXM2-32GB": {"fp16": 125e12, "fp32": 15.7e12},
}


def peak_flops_for(name: str, precision: str) -> float:
    """Dense peak FLOP/s of the GPU named `name` (as torch.cuda.get_device_name() gives it) in
    `precision` (bf16 | fp16 | fp32); 0.0 when not in PEAK_FLOPS."""
    return PEAK_FLOPS.get(name, {}).get(precision, 0.0)


def peak_flops(device: torch.device, precision: str, configured: float) -> float:
    """Peak FLOP/s of one device: the configured value, else looked up by GPU name (0 = unknown,
    e.g. on CPU, where MFU is not reported)."""
    if configured:
        return configured
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    peak = peak_flops_for(name, precision)
    if not peak:
        log.warning("warning: no peak FLOP/s known for %s in %s, so MFU is not reported; set "
                    "distributed.peak_flops (FLOP/s per device, dense) to report it", name, precision)
    return peak


def memory_stats(device: torch.device) -> dict:
    """Peak GPU memory allocated since the last call (GiB); on CPU the process RSS now and its peak
    since the start (GiB)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
        return {"memory/gpu_peak_allocated_gib": round(peak, 3)}
    import psutil

    return {"memory/rss_gib": round(psutil.Process().memory_info().rss / 2**30, 3),
            "memory/rss_peak_gib": round(_peak_rss() / 2**30, 3)}


def _peak_rss() -> int:
    """This process's peak resident bytes. Linux's VmHWM, not getrusage's ru_maxrss: the latter
    carries over exec, so a trainer started by a large parent (a sweep runner, a test session)
    reports the parent's size as its own peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


class MetricLogger:
    """The no-op base. `log` takes flat dicts of floats keyed like 'train/loss'."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def rewind(self, step: int) -> None:
        """The run went back to step `step` (a rollback): records after it are of an abandoned timeline."""

    def close(self) -> None:
        pass


class JsonlLogger(MetricLogger):
    """Appends one JSON object per record to run_dir/metrics.jsonl, kept across resumes: one line
    per step, the curve the weights followed. Records after `keep_until_step` are dropped first: they
    belong to steps the resumed checkpoint does not hold (a run killed after its last checkpoint),
    which the resumed run trains and logs again; a rollback drops those of its abandoned timeline."""

    def __init__(self, run_dir: Path, keep_until_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        if self.path.is_file():
            self._rewind(keep_until_step)
        self.file = open(self.path, "a", buffering=1)

    def rewind(self, step: int) -> None:
        self.file.close()
        self._rewind(step)
        self.file = open(self.path, "a", buffering=1)

    def _rewind(self, step: int) -> None:
        lines = self.path.read_text().splitlines()
        kept = []
        for line in lines:
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except ValueError:  # a line cut short by a crash
                pass
        if len(kept) == len(lines):
            return
        from pretrain.checkpoint.rundir import write_atomic

        write_atomic(self.path, "".join(f"{line}\n" for line in kept))
        log.info("metrics.jsonl: dropped %d records after step %d (logged after the checkpoint restored)",
                 len(lines) - len(kept), step)

    def log(self, metrics: dict, step: int) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        self.file.close()


class WandbLogger(MetricLogger):
    """W&B: offline without an API key (sync later with `wandb sync`). The W&B run id is the run's
    own id (run.json), so every restart of a run, resumed or requeued, continues one W&B run."""

    def __init__(self, run_dir: Path, mode: str, project: str, entity: str, name: str,
                 config: dict, run_id: str, group: str = ""):
        import wandb

        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity or None, name=name or Path(run_dir).name, group=group or None,
                              dir=str(run_dir), mode=mode, id=run_id, resume="allow",
                              config=config, settings=wandb.Settings(silent=True, console="off"))
        # Scaling-law axes: every train/ and eval/ metric can be plotted against tokens and FLOPs.
        for axis in ("tokens_seen", "flops"):
            self.run.define_metric(axis)
        self.run.define_metric("train/*", step_metric="tokens_seen")
        self.run.define_metric("eval/*", step_metric="tokens_seen")
        self.run.define_metric("compute/*", step_metric="flops")

    def log(self, metrics: dict, step: int) -> None:
        if self.run is None:
            return
        record = dict(metrics)
        if "train/loss" in record:
            record["compute/loss"] = record["train/loss"]
        if "eval/loss" in record:
            record["compute/eval_loss"] = record["eval/loss"]
        try:
            self.run.log(record, step=step)
        except Exception as e:  # a W&B failure must never cost the run (or its checkpoint)
            self._lost(e)

    def close(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as e:
                self._lost(e)
            self.run = None

    def _lost(self, e: Exception) -> None:
        # Slurm's SIGTERM also reaches the wandb service process; metrics.jsonl keeps everything.
        log.warning("warning: W&B logging stopped (%s: %s); metrics.jsonl continues", type(e).__name__, e)
        self.run = None


class Loggers(MetricLogger):
    """Fans out to several loggers; closes all even if one fails."""

    def __init__(self, loggers: list[MetricLogger]):
        self.loggers = loggers

    def log(self, metrics: dict, step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)

    def rewind(self, step: int) -> None:
        for lg in self.loggers:
            lg.rewind(step)

    def close(self) -> None:
        errors = []
        for lg in self.loggers:
            try:
                lg.close()
            except Exception as e:  # keep closing the others
                errors.append(e)
        if errors:
            raise errors[0]


# -- the largest attention logit (logging.attn_logits)

ATTN_CHUNK_ELEMENTS = 1 << 21  # fp32 logits held at once while measuring (8 MiB): queries go a block at a time


def attention_logit_maxima(model: torch.nn.Module, forward: Callable[[], object]) -> torch.Tensor:
    """The largest attention logit of each Attention module that the forward `forward()` runs
    through `model`: max of q.k x the softmax scale (the q and k the attention uses: after q/k norms
    and RoPE; in fp32) over heads and the query/key pairs its mask keeps (causal, the layer's window,
    a packed-document mask; a sink's logit is not a q.k and is left out). Their growth at high
    learning rates is the instability Wortsman et al. 2023 measure (arXiv 2309.14322). Returns an
    fp32 tensor (n attention calls,) on the model's device, in call order.

    `forward` runs without gradients and eagerly (compiled modules too, so no graph sees the probe).
    Each Attention's `qkv` is wrapped for its duration, so every module is called once, in the
    usual order: under ZeRO-3 the parameters are gathered as in any forward (every rank must run it).
    A rank sees its own batch, its heads under tensor parallelism, and under sequence parallelism
    the causal pairs within its slice of the sequences (documents not separated there): the caller
    takes the max over ranks. For a forward without a KV cache (a training or eval forward)."""
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    found: list[torch.Tensor] = []
    masks: dict[int, object] = {}

    def keep_mask(module, args, kwargs):  # Attention.forward(x, freqs_cis, cache_k, cache_v, start_pos, mask)
        masks[id(module)] = kwargs.get("mask", args[5] if len(args) > 5 else None)

    def measured(module: Attention, qkv):
        def wrapped(x, freqs_cis):
            q, k, v = qkv(x, freqs_cis)
            found.append(_max_logit(q, k, module.scale, module.window, masks.pop(id(module), None)))
            return q, k, v
        return wrapped

    handles = [m.register_forward_pre_hook(keep_mask, with_kwargs=True) for m in attentions]
    for m in attentions:
        m.qkv = measured(m, m.qkv)
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            forward()
    finally:
        for h in handles:
            h.remove()
        for m in attentions:
            del m.qkv  # (the instance attribute: the class's method again)
    return torch.stack(found) if found else torch.empty(0)


def _max_logit(q: torch.Tensor, k: torch.Tensor, scale: float | None, window: int, mask) -> torch.Tensor:
    """max of q (B, T, H, hd) . k (B, S, KV, hd) x scale (None: 1/sqrt(hd)) over the pairs `mask`
    keeps (None: causal within `window`; a boolean (..., T, S) tensor; a BlockMask), fp32, 0-dim.
    Every mask here is causal: a block of queries meets only the keys up to its last one (and from
    its first one's window on), so about half the T x S logits are computed."""
    B, T, H, hd = q.shape
    S, KV = k.size(1), k.size(2)
    G = H // KV
    scale = scale if scale is not None else hd ** -0.5
    q = q.float().transpose(1, 2).reshape(B, KV, G, T, hd)  # query head h = kv x G + g uses KV head kv
    k = k.float().permute(0, 2, 3, 1)  # (B, KV, hd, S)
    rows = max(1, ATTN_CHUNK_ELEMENTS // (B * H * S))
    best = torch.full((), -math.inf, device=q.device)
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        lo, hi = max(0, S - T + t0 - window + 1) if window else 0, S - T + t1  # the keys these queries may see
        logits = (q[:, :, :, t0:t1].reshape(B, KV, G * (t1 - t0), hd) @ k[..., lo:hi]) * scale
        logits = logits.view(B, KV, G, t1 - t0, hi - lo)
        keep = _kept(mask, window, t0, t1, lo, hi, T, S, B, q.device)  # broadcasts to (B, 1, 1, rows, keys)
        best = torch.maximum(best, logits.masked_fill_(~keep, -math.inf).amax())
    return best


def _kept(mask, window: int, t0: int, t1: int, lo: int, hi: int, T: int, S: int, B: int, device) -> torch.Tensor:
    """The pairs of queries t0:t1 and keys lo:hi the layer attends: (B, 1, 1, rows, keys) or (rows,
    keys), True = kept. The T queries sit at the last T of S positions. A mask of other lengths
    (sequence parallelism's, of the whole sequences) gives way to the causal one."""
    if isinstance(mask, BlockMask) and tuple(mask.seq_lengths) == (T, S):
        b = torch.arange(B, device=device)[:, None, None]
        q = torch.arange(t0, t1, device=device)[None, :, None]
        kv = torch.arange(lo, hi, device=device)[None, None, :]
        return mask.mask_mod(b, torch.zeros_like(b), q, kv)[:, None, None]  # (mask_mods broadcast: ours index)
    if torch.is_tensor(mask) and tuple(mask.shape[-2:]) == (T, S):
        part = mask[..., t0:t1, lo:hi]  # (B, 1, rows, keys) or (rows, keys)
        return part[:, :, None] if part.dim() == 4 else part
    q = torch.arange(S - T + t0, S - T + t1, device=device)[:, None]
    kv = torch.arange(lo, hi, device=device)[None, :]
    keep = kv <= q
    return keep & (q - kv < window) if window else keep
