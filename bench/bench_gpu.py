"""GPU throughput, MFU and peak memory: the trainer, the same model in a plain PyTorch loop, and HF
LlamaForCausalLM, measured in one run on one GPU.

    python bench/bench_gpu.py                                   # 125m, 350m, 1b at seq 2048, bf16
    python bench/bench_gpu.py --presets 125m --json $OUT/gpu.json
    python bench/bench_gpu.py --device cpu --presets tiny --seq-len 128 --steps 6 --warmup 2   # smoke test

For each preset, activation checkpointing off and on (every block), compile off and on:
- trainer: `pretrain train` (DeepSpeed, ZeRO stage 0 on one device, bf16 with fp32 master weights,
  the chunked loss), on a synthetic prepared token source written here (random ids; no tokenizing);
  trainer-fp8 the same with train.precision=fp8 (--fp8-recipe; emulated on a CPU);
- plain: the same model in a textbook loop: bf16 autocast over fp32 weights, fused AdamW, clipping;
- hf: transformers' LlamaForCausalLM of the same shape (SDPA attention), the same loop.
The three alternate within each configuration. MFU = tokens/s x the PaLM FLOPs per token / peak,
the bf16 dense peak of the GPU by its name (pretrain/metrics.py; --peak-flops for one not listed,
else no MFU). Vocabulary 32,000 (the presets' own). The trainer's runs save no checkpoint at the
end (17 GB for 1b, nothing the bench reads). Prints a table; --json writes every figure. Needs
deepspeed (and no datasets, wandb): see docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 32000
MICRO = {"tiny": 4, "125m": 16, "350m": 8, "1b": 4}  # sequences per micro-batch at seq 2048
# `pretrain train` without its save at the end of the run: the trainer has no setting for that, and
# the bench only reads metrics.jsonl.
TRAIN_WITHOUT_FINAL_SAVE = ("import sys; from pretrain.trainer import Trainer; "
                            "Trainer.save = lambda self, wait=False: None; "
                            "from pretrain.cli import main; sys.exit(main())")


def synthetic_source(out: Path, tokens: int) -> Path:
    """A prepared source of random token ids (below the builtin tokenizer's 4096) with the meta the
    loader checks."""
    import numpy as np

    import data_pipeline as dp
    from data_pipeline.sources import PREPARED_FORMAT

    tok = dp.load_tokenizer("builtin:python-docs-bpe")
    out.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(0).integers(0, 4096, tokens, dtype=np.uint16).tofile(out / "tokens-00000.bin")
    meta = {"format": PREPARED_FORMAT, "tokenizer": "builtin:python-docs-bpe",
            "tokenizer_fingerprint": dp.tokenizer_fingerprint(tok), "eot_id": dp.eot_id(tok, ""), "vocab_size": 4096,
            "dtype": "uint16", "tokens": tokens, "docs": 1, "empty_docs": 0,
            "source": {"path": "synthetic", "kind": "synthetic", "fingerprint": "random"},
            "shards": [{"file": "tokens-00000.bin", "tokens": tokens}]}
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def run_trainer(a, preset: str, micro: int, ac: int, compile_: bool, data: Path, docmask: bool = False,
                fp8: bool = False) -> dict:
    """`pretrain train` (bf16, or fp8: train.precision=fp8 with --fp8-recipe, emulated on a CPU),
    logging every step: tokens/s is the median of the steps after the warm-up, every step's loss is
    returned."""
    precision = ["train.precision=fp8", f"train.fp8_recipe={a.fp8_recipe}",
                 f"train.fp8_emulate={str(a.device == 'cpu').lower()}"] if fp8 else []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-c", TRAIN_WITHOUT_FINAL_SAVE, "train", str(REPO / "configs" / "tiny.yaml"),
               f"model.preset={preset}", f"model.vocab_size={VOCAB}", f"model.max_seq_len={a.seq_len}",
               f"data.sources=[{{path: {data}, kind: prepared}}]", "data.validation=[]", f"data.seq_len={a.seq_len}",
               "data.num_streams=1", f"train.micro_batch_size={micro}", f"train.max_steps={a.steps}",
               f"train.activation_checkpointing={ac}", f"train.compile={str(compile_).lower()}", "train.eval_every=0",
               "distributed.zero_stage=0", "logging.log_every=1", "logging.wandb=disabled",
               "logging.progress=false", f"train.run_dir={tmp}", f"model.document_mask={str(docmask).lower()}",
               *precision]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
        rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/tokens_per_s" in r]
    out = {"tokens_per_s": statistics.median(r["perf/tokens_per_s_per_device"] for r in rows[a.warmup:]),
           "losses": [r["train/loss"] for r in rows if "train/loss" in r]}
    if "memory/gpu_peak_allocated_gib" in rows[-1]:
        out["peak_gib"] = max(r["memory/gpu_peak_allocated_gib"] for r in rows)
    return out


def run_loop(a, preset: str, micro: int, ac: int, compile_: bool, kind: str) -> dict:
    """The plain loop or HF's model (in this process), timed over the steps after the warm-up.

    kind: plain | hf | plain-fp8 (torchao float8 training, tensorwise, of every block's linear layer) |
    docmask-flex / docmask-dense (the plain loop with document masking: documents of random lengths,
    FlexAttention's block mask, or the dense boolean mask through SDPA). Every step's loss is
    returned, so that two kinds from the same seed can be compared step by step."""
    import torch
    import torch.nn.functional as F

    import pretrain.model.attention as model_module

    from pretrain.hf.mapping import to_hf_config
    from pretrain.model.args import PRESETS, ModelArgs
    from pretrain.model.model import Transformer
    from pretrain.parallel.parallelize import apply_activation_checkpointing

    hf = kind == "hf"
    dev = torch.device(a.device)
    docmask = kind.startswith("docmask")
    args = ModelArgs(**{**PRESETS[preset], "vocab_size": VOCAB, "max_seq_len": a.seq_len, "document_mask": docmask,
                          "eot_id": 0})  # (documents are given: the id is unused)
    if kind == "docmask-dense":
        model_module.FLEX_DEVICES = set()
    torch.manual_seed(0)
    if hf:
        from transformers import LlamaForCausalLM

        cfg = to_hf_config(args)
        cfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(cfg).to(dev)
        if ac:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model = Transformer(args)
        model.init_weights()
        model = model.to(dev)
        if kind == "plain-fp8":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(a.fp8_recipe),
                                       module_filter_fn=lambda m, name: name != "output")
        apply_activation_checkpointing(model, ac)
    if compile_:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    x = torch.randint(0, VOCAB, (micro, a.seq_len), device=dev)
    y = torch.randint(0, VOCAB, (micro, a.seq_len), device=dev)
    # documents of 1..seq_len/4 tokens (random boundaries), the same for both masks
    docs = (torch.rand(micro, a.seq_len, device=dev) < 8 / a.seq_len).cumsum(-1) if docmask else None
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(a.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            if hf:
                loss = F.cross_entropy(model(x).logits.float().flatten(0, 1), y.flatten())
            else:
                loss = model(x, y, documents=docs)  # the chunked loss, as the trainer uses it
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    out = {"tokens_per_s": micro * a.seq_len / statistics.median(times[a.warmup:]), "losses": losses}
    if dev.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="125m,350m,1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps (compilation); --steps a multiple of it")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kinds", default="trainer,plain,hf",
                   help="of trainer, trainer-fp8, trainer-docmask, plain, hf, plain-fp8, docmask-flex, docmask-dense")
    p.add_argument("--ac", default="0,1", help="activation checkpointing settings to run (0 off, 1 every block)")
    p.add_argument("--compile", default="0,1", help="compile settings to run (0 off, 1 on)")
    p.add_argument("--fp8-recipe", default="tensorwise", help="torchao float8 recipe for trainer-fp8 and plain-fp8")
    p.add_argument("--peak-flops", type=float, default=0.0,
                   help="peak FLOP/s of the GPU for MFU (default: by its name, for bf16 dense)")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--loop", help=argparse.SUPPRESS)  # child process: "plain|hf preset micro ac compile"
    a = p.parse_args()
    if a.loop:
        kind, preset, micro, ac, comp = a.loop.split()
        print(json.dumps(run_loop(a, preset, int(micro), int(ac), comp == "1", kind)))
        return
    from pretrain.metrics import peak_flops_for
    from pretrain.model.args import PRESETS, ModelArgs
    from pretrain.model.model import flops_per_token

    peak = a.peak_flops or peak_flops_for(_gpu_name(a.device), "bf16")
    if not peak:
        print(f"no peak FLOP/s known for {_gpu_name(a.device)}: MFU left out (give --peak-flops)", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in a.presets.split(","):
            micro = MICRO[preset]
            data = synthetic_source(Path(tmp) / preset, (a.steps + 2) * micro * (a.seq_len + 1) + 1)
            fpt = flops_per_token(ModelArgs(**{**PRESETS[preset], "vocab_size": VOCAB}), a.seq_len)
            for ac in map(int, a.ac.split(",")):
                for comp in (c == "1" for c in a.compile.split(",")):
                    row = {"preset": preset, "micro_batch": micro, "seq_len": a.seq_len, "ac": ac, "compile": comp}
                    kinds = a.kinds.split(",")
                    for kind in kinds if (ac + comp) % 2 == 0 else kinds[::-1]:  # alternate the order
                        if kind.startswith("trainer"):
                            got = run_trainer(a, preset, micro, ac, comp, data, docmask=kind == "trainer-docmask",
                                              fp8=kind == "trainer-fp8")
                        else:
                            proc = subprocess.run([sys.executable, __file__, "--device", a.device, "--seq-len",
                                                   str(a.seq_len), "--steps", str(a.steps), "--warmup", str(a.warmup),
                                                   "--fp8-recipe", a.fp8_recipe,
                                                   "--loop", f"{kind} {preset} {micro} {ac} {int(comp)}"],
                                                  cwd=REPO, capture_output=True, text=True)
                            got = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else \
                                {"error": proc.stderr.strip().splitlines()[-1:]}
                        if "tokens_per_s" in got and peak:
                            got["mfu"] = got["tokens_per_s"] * fpt / peak
                        row[kind] = got
                        print(json.dumps({"kind": kind, **got}), flush=True)
                    results.append(row)
                    print(json.dumps(row), flush=True)
                    if a.json:  # after every row: a run cut short keeps what it measured
                        Path(a.json).write_text(json.dumps({"results": results, "peak_flops": peak, "vocab": VOCAB,
                                                            "device": _device(a.device)}, indent=1))
    print("\n| preset | AC | compile | kind | tok/s | MFU | peak GiB | final loss |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for kind in a.kinds.split(","):
            print(_line(r, kind))


def _line(r: dict, kind: str) -> str:
    got = r[kind]
    if "tokens_per_s" not in got:
        return f"| {r['preset']} | {r['ac']} | {int(r['compile'])} | {kind} | {got.get('error')} | | | |"
    mfu, peak, losses = got.get("mfu"), got.get("peak_gib"), got.get("losses")
    return (f"| {r['preset']} | {r['ac']} | {int(r['compile'])} | {kind} | {got['tokens_per_s']:,.0f} | "
            f"{'-' if mfu is None else f'{mfu:.1%}'} | {'-' if peak is None else f'{peak:.1f}'} | "
            f"{'-' if not losses else f'{losses[-1]:.4f}'} |")


def _gpu_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else "cpu"


def _device(device: str) -> str:
    import torch

    return f"{_gpu_name(device)}, torch {torch.__version__}, {os.cpu_count()} CPU cores"


if __name__ == "__main__":
    main()
