"""The `pretrain` command. Subcommands import their heavy dependencies only when they run.

User errors print as one line each (`pretrain: error: ...`) and exit with their code, no traceback.
Under a launcher with several ranks, an error every rank hit alike prints once, on rank 0; a rank
that failed alone prints its own. Under torchrun the line also goes to torchrun's error file, so
its failure report shows it instead of "To enable traceback see ...".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pretrain.errors import USER_ERRORS, ConfigError


def _config_show(args) -> None:
    from pretrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    print(cfg.to_yaml(), end="")


def _train(args) -> int:
    from pretrain.train import run

    return run(args.config, args.overrides, args.stop)


def _train_tokenizer(args) -> None:
    from data_pipeline.config import SourceConfig
    from data_pipeline.tokenizer import train_tokenizer

    sources = [SourceConfig(path=p, kind=args.kind, text_field=args.text_field) for p in args.sources]
    tok = train_tokenizer(sources, args.vocab_size, args.out, special_tokens=args.special_tokens)
    print(f"wrote {args.out} (vocab {tok.get_vocab_size()})")


def _prepare(args) -> None:
    from data_pipeline.prepare import prepare
    from pretrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    prepare(cfg.data, args.out, num_proc=args.num_proc, task_index=args.task_index, num_tasks=args.num_tasks,
            merge=args.merge, progress=not args.no_progress)


def _export(args) -> None:
    from pretrain.hf.export import export

    export(args.checkpoint, args.out_dir, args.dtype)


def _eval(args) -> None:
    from pretrain.eval.evaluate import eval_cli

    eval_cli(args)


def _scaling(name: str):
    def run(args) -> None:
        import pretrain.scaling

        getattr(pretrain.scaling, name)(args)
    return run


def _mup_check(args) -> None:
    from pretrain.mup import check_cli

    check_cli(args)


def _plot(args) -> None:
    from pretrain.plot import plot_cli

    plot_cli(args)


def _estimate(args) -> None:
    from pretrain.build import model_args
    from pretrain.config import load_config
    from pretrain.estimate.report import Assumptions, estimate, report
    from pretrain.metrics import peak_flops_for

    cfg = load_config(args.config, args.overrides)
    precision = args.precision or (cfg.train.precision if cfg.train.precision != "auto" else "bf16")
    peak = args.peak_tflops or (cfg.distributed.peak_flops / 1e12 if cfg.distributed.peak_flops else peak_flops_for(
        "NVIDIA H100 80GB HBM3", "bf16" if precision == "fp8" else precision) / 1e12)  # (fp8: MFU of bf16's peak)
    e = estimate(cfg, model_args(cfg), Assumptions(args.gpus, args.mfu, peak, args.gbps, precision, args.gpu_memory,
                                                   gpus_per_node=args.gpus_per_node, fp8_speedup=args.fp8_speedup))
    print(report(e))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(e, f, indent=1)


def _generate(args) -> None:
    from pretrain.eval.generate import generate_cli

    generate_cli(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain", description="Pretrain GPT-style language models.")
    # The `deepspeed` launcher inserts --local_rank=N before the subcommand; LOCAL_RANK says the same.
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(sp):
        sp.add_argument("config", help="YAML run config (e.g. configs/tiny.yaml)")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=50")
        return sp

    cfg = sub.add_parser("config", help="inspect run configs").add_subparsers(dest="sub", required=True)
    with_config(cfg.add_parser("show", help="print the fully resolved config")).set_defaults(fn=_config_show)

    with_config(sub.add_parser("train", help="train (or resume, or fine-tune) a model")).set_defaults(fn=_train)

    data = sub.add_parser("data", help="tokenizers and pre-tokenized shards").add_subparsers(
        dest="sub", required=True)
    tt = data.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer.json")
    tt.add_argument("sources", nargs="+", help="local files/globs, hub dataset names or builtin:NAME")
    tt.add_argument("--out", required=True, help="output tokenizer.json path")
    tt.add_argument("--vocab-size", type=int, default=32000, help="vocabulary size including specials")
    tt.add_argument("--kind", default="auto", help="source kind: auto|hub|text|json|parquet|builtin")
    tt.add_argument("--text-field", default="text", help="text column for json/parquet/hub sources")
    tt.add_argument("--special-tokens", nargs="*", default=["<|endoftext|>"],
                    help="special tokens; the first is the end-of-text token")
    tt.set_defaults(fn=_train_tokenizer)
    pr = with_config(data.add_parser("prepare", help="tokenize data.sources into binary token shards"))
    pr.add_argument("--out", required=True, help="output directory for shards and meta.json")
    pr.add_argument("--num-proc", type=int, default=0, help="processes (0 = all cores)")
    pr.add_argument("--task-index", type=int, default=0, help="this task's index, for --num-tasks > 1")
    pr.add_argument("--num-tasks", type=int, default=1,
                    help="independent tasks sharing the input shards (task I takes shard k if k %% N == I); "
                         "then --merge")
    pr.add_argument("--merge", action="store_true", help="write meta.json once every task has finished")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar")
    pr.set_defaults(fn=_prepare)

    ex = sub.add_parser("export", help="export a checkpoint to Hugging Face Llama format")
    ex.add_argument("checkpoint", help="checkpoint directory (a step folder or a run's checkpoints dir)")
    ex.add_argument("out_dir", help="output directory (safetensors, config.json, tokenizer files)")
    ex.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the exported weights")
    ex.set_defaults(fn=_export)

    ev = sub.add_parser("eval", help="loss, perplexity and bits per byte of a model on held-out data")
    ev.add_argument("model", help="checkpoint, run dir, Hugging Face model directory or hub:NAME")
    ev.add_argument("config", nargs="?", help="YAML run config for the data (default: the checkpoint's own)")
    ev.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.seq_len=512")
    ev.add_argument("--data", help="score this source instead (a local file, glob, folder, or hub dataset name)")
    ev.add_argument("--batches", type=int, default=0, help="score the first N global batches (0 = one full pass)")
    ev.add_argument("--micro-batch-size", type=int, default=0, help="sequences per forward (0 = the config's)")
    ev.add_argument("--by-position", type=int, default=0, metavar="N",
                    help="also the mean loss per bucket of N positions in the window ([0,N), [N,2N), ...; 0 = off): "
                         "loss past a model's old context, before and after extending it (docs/long_context.md)")
    ev.add_argument("--tasks", default="", help="score downstream tasks instead: comma-separated names "
                    "(hellaswag, arc_easy, arc_challenge, piqa, winogrande, lambada_openai, sciq), NAME=FILE for "
                    "local files in the hub schema, or .jsonl files of your own (docs/evaluation.md)")
    ev.add_argument("--limit", type=int, help="with --tasks: the first N instances of each (default: all)")
    ev.add_argument("--fewshot", type=int, default=0, help="with --tasks: examples before each instance")
    ev.add_argument("--seed", type=int, default=1234, help="with --tasks: the few-shot examples' seed")
    ev.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                    help="dtype the model scores in: auto = bf16 on CUDA, fp32 on CPU; fp32 gives lm-eval's HFLM "
                         "numbers on the fp32 export (docs/evaluation.md)")
    ev.add_argument("--json", help="also write the result to this JSON file")
    ev.set_defaults(fn=_eval)

    sc = sub.add_parser("scaling", help="scaling-law sweeps: plan, run, fit, plot, compare (docs/scaling.md)")
    sc = sc.add_subparsers(dest="sub", required=True)
    pl = with_config(sc.add_parser("plan", help="write the runs of a sweep over compute budgets and model sizes"))
    pl.add_argument("--budgets", required=True, help="comma-separated compute budgets in FLOPs, e.g. 1e15,3e15,1e16")
    pl.add_argument("--out", required=True, help="sweep directory (configs/, manifest.csv, runs/)")
    pl.add_argument("--sizes", type=int, default=7, help="model sizes per budget (5-9 usual)")
    pl.add_argument("--span", type=float, default=8.0, help="largest / smallest size per budget")
    pl.add_argument("--schedule", default="cosine", choices=["cosine", "wsd", "wsd-s"],
                    help="cosine or wsd: a run per point; wsd-s: a run per size, decay branches at each budget")
    pl.add_argument("--lr", type=float, default=0.0,
                    help="one learning rate for every run (default: sp scales the config's by width; mup and "
                         "completep use it for every size)")
    pl.add_argument("--parametrization", default="", choices=["", "sp", "mup", "completep"],
                    help="the family's parametrization, the base config's model its base (default: the config's)")
    pl.add_argument("--name", default="", help="sweep name, the W&B group (default: the directory name)")
    pl.add_argument("--replace", action="store_true",
                    help="DIR holds runs of another plan: move them and that plan to DIR/replaced/ (else refused)")
    pl.set_defaults(fn=_scaling("plan_cli"))
    ls = with_config(sc.add_parser("lr-sweep", help="tune the base learning rate at the base model (for muP): one "
                                                     "run per rate, trained here, best by eval loss"))
    ls.add_argument("--lrs", required=True, help="comma-separated rates, e.g. 1e-3,2e-3,4e-3,8e-3 (factors of 2)")
    ls.add_argument("--out", required=True, help="sweep directory (configs/, manifest.csv, runs/, lr_sweep.json)")
    ls.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun)")
    ls.add_argument("--plan-only", action="store_true", help="write the runs' configs and stop (train them with "
                                                               "`scaling run` or Slurm; then run this again)")
    ls.add_argument("--name", default="", help="sweep name, the W&B group (default: the directory name)")
    ls.add_argument("--replace", action="store_true", help="DIR holds runs of another plan: move them to DIR/replaced/")
    ls.set_defaults(fn=_scaling("lr_sweep_cli"))
    ru = sc.add_parser("run", help="train a sweep's runs here, one after another (skips finished, resumes others)")
    ru.add_argument("dir", help="sweep directory")
    ru.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun)")
    ru.add_argument("--index", type=int, help="only the run of this index (a Slurm array task)")
    ru.add_argument("--config-of", type=int, help="print the config of run I (nothing if finished) and exit")
    ru.set_defaults(fn=_scaling("run_cli"))
    fi = sc.add_parser("fit", help="fit IsoFLOP and parametric laws; N*, D* for a budget")
    fi.add_argument("inputs", nargs="+", help="sweep dirs, run dirs, or CSV files with params,tokens,loss[,budget]")
    fi.add_argument("--budget", type=float, default=0.0, help="compute budget (FLOPs) to recommend N*, D* for")
    fi.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the intervals")
    fi.add_argument("--json", help="also write the fits to this JSON file")
    _ladder_args(fi)
    fi.set_defaults(fn=_scaling("fit_cli"))
    po = sc.add_parser("plot", help="PNGs of the fits: IsoFLOP curves, loss vs compute, N_opt/D_opt, residuals")
    po.add_argument("inputs", nargs="+", help="sweep dirs, run dirs, or CSV files with params,tokens,loss,budget")
    po.add_argument("--out", required=True, help="directory for the PNGs")
    po.add_argument("--budget", type=float, default=0.0, help="mark this compute budget on the plots")
    _ladder_args(po)
    po.set_defaults(fn=_scaling("plot_cli"))
    co = sc.add_parser("compare", help="one ladder trained two ways (e.g. AdamW, Muon): losses at equal N and D, "
                                       "the compute multiplier, intervals (docs/optimizers.md)")
    co.add_argument("a", help="the baseline: a sweep dir (or run dir, or CSV of points), e.g. the AdamW ladder")
    co.add_argument("b", help="the other, planned alike, e.g. the Muon ladder")
    co.add_argument("--budget", type=float, default=0.0,
                    help="compute for the compute-optimal multiplier (default: the largest budget)")
    co.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the intervals")
    co.add_argument("--out", help="directory for compare.png")
    co.add_argument("--json", help="also write the comparison to this JSON file")
    co.add_argument("--by-law", action="store_true",
                    help="set each B point against A's law at its N and D, for ladders whose points differ (an MoE "
                         "family's active N against a dense family's: docs/moe.md)")
    co.set_defaults(fn=_scaling("compare_cli"))

    mu = sub.add_parser("mup", help="muP / CompleteP: coordinate checks (docs/mup.md)").add_subparsers(
        dest="sub", required=True)
    mc = with_config(mu.add_parser("check", help="train each width (and depth) a few steps and fit how the "
                                                  "activations' RMS scales with it"))
    mc.add_argument("--widths", default="64,128,256,512", help="model.dim values, comma-separated ('' = none)")
    mc.add_argument("--depths", default="", help="model.n_layers values, comma-separated (CompleteP)")
    mc.add_argument("--steps", type=int, default=10, help="training steps at each size")
    mc.add_argument("--seeds", type=int, default=8, help="seeds averaged at each size")
    mc.add_argument("--batch-size", type=int, default=2, help="sequences in the one batch trained on and measured")
    mc.add_argument("--seq-len", type=int, default=16, help="tokens per sequence of that batch")
    mc.add_argument("--json", default="", help="write the RMS values and slopes here")
    mc.add_argument("--out", default="", help="directory for coord_check_width.png / coord_check_depth.png")
    mc.set_defaults(fn=_mup_check)

    pt = sub.add_parser("plot", help="PNGs of runs' metrics from their metrics.jsonl (no W&B needed)")
    pt.add_argument("runs", nargs="+", help="run dirs (or metrics.jsonl files); several are overlaid")
    pt.add_argument("--out", required=True, help="directory for the PNGs (one per metric)")
    pt.add_argument("--metrics", default="", help="comma-separated metrics (default: train/loss, eval/loss, "
                                                   "train/lr, train/grad_norm, those logged)")
    pt.add_argument("--x", default="step", choices=["step", "tokens", "flops"], help="the x axis")
    pt.set_defaults(fn=_plot)

    est = with_config(sub.add_parser("estimate", help="parameters, FLOPs, memory per GPU, step time, "
                                                      "communication for a run config"))
    est.add_argument("--gpus", type=int, required=True, help="number of GPUs of the run")
    est.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilization (0-1)")
    est.add_argument("--peak-tflops", type=float, default=0.0,
                     help="per-GPU peak TFLOPS (default: distributed.peak_flops, else H100's for the precision)")
    est.add_argument("--gbps", type=float, default=400.0, help="interconnect bandwidth per GPU in Gbit/s")
    est.add_argument("--gpu-memory", type=float, default=80.0,
                     help="memory per GPU in GiB: rows that need more are marked (default 80)")
    est.add_argument("--gpus-per-node", type=int, default=8,
                     help="GPUs per node, joined by NVLink: tensor parallelism and hpZ stay within one (default 8)")
    est.add_argument("--precision", choices=["bf16", "fp16", "fp32", "fp8"], help="training precision (default: the "
                     "config's; auto means bf16 on GPUs)")
    est.add_argument("--fp8-speedup", type=float, default=0.0,
                     help="fp8: the converted linears' speed over bf16's (default: the recipe's, docs/performance.md)")
    est.add_argument("--json", help="also write every figure to this JSON file")
    est.set_defaults(fn=_estimate)

    gen = sub.add_parser("generate", help="sample text from a checkpoint or an export")
    gen.add_argument("model", help="checkpoint directory or export directory")
    gen.add_argument("--prompt", default="", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.set_defaults(fn=_generate)
    return p


def _ladder_args(p) -> None:
    p.add_argument("--target", help="a task ladder instead: TASK/METRIC (e.g. hellaswag/acc_norm), predicted "
                   "from the task's bpb (docs/scaling.md)")
    p.add_argument("--params", type=float, default=0.0, help="with --target: the target's N (matmul parameters)")
    p.add_argument("--tokens", type=float, default=0.0, help="with --target: the target's D (training tokens)")


def _rank() -> int:
    """This process's rank as the launcher set it (known before any process group exists)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)) or 0)


def _report(lines: list[str], collective: bool) -> None:
    if not collective or _rank() == 0:
        for line in lines:
            print(f"pretrain: error: {line}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun's failure report reads it (the format of torch's own @record)
        text = "\n".join(f"pretrain: error: {line}" for line in lines)
        try:
            with open(error_file, "w") as f:
                json.dump({"message": {"message": text, "extraInfo": {"py_callstack": text,
                                                                      "timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow the options (`pretrain estimate CFG --gpus 8 train.max_steps=10`).
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.fn is _train:
        # First thing: a SIGTERM while torch and DeepSpeed import must not be lost (train.py's
        # top-level imports are light for this reason).
        from pretrain.train import StopSignal

        args.stop = StopSignal()
        import faulthandler

        faulthandler.enable()  # a rank that crashes in native code (SIGSEGV, SIGABRT) prints its Python stack
    try:
        code = args.fn(args)
    except ConfigError as e:
        _report(e.problems, e.collective)
        return e.exit_code
    except USER_ERRORS as e:
        _report([str(e)], getattr(e, "collective", False))
        return e.exit_code
    except KeyboardInterrupt:
        print("pretrain: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from pretrain.parallel.distributed import PeerFailed

        if isinstance(e, PeerFailed):  # the failing rank printed its own error
            return e.exit_code
        raise
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
