"""Mutation check: do the tests catch the bugs that matter? (Not part of CI; see docs/testing.md.)

    python tests/mutation.py                      # every mutant; a table; exit 1 if one survived
    python tests/mutation.py --list               # the mutants, their files and the tests that should kill them
    python tests/mutation.py --only compile,rope-table --json out.json
    python tests/mutation.py --check              # only: does every mutant's snippet still match?

Each mutant is a small change to a switch or an invariant (a call left out, a flag ignored, an
off-by-one), made as an exact string replacement that must match exactly once (else the mutant is
STALE: the code moved, update the mutant). For each one the repository's files (tracked ones as
they are in the working tree, plus untracked files git does not ignore) are copied into a fresh
temporary directory, the mutant is applied there, and its tests run in that copy:

    python -m pytest -q -x -p no:cacheprovider -rfE <tests>     (cwd = the copy, PYTHONPATH = the copy)

PYTHONPATH puts the copy ahead of the editable install, for pytest and for every process the tests
start (`sys.executable -m pretrain`, torchrun ranks), whose cwd is the copy too. The working tree is
never touched. A mutant is killed when its tests fail (pytest exit 1, or 2 for a collection error,
e.g. an import the mutant broke); it SURVIVED when they pass. The selected tests first run once on
an unmutated copy (the baseline): if they do not pass there, nothing is concluded and the check
stops. Two canary mutants (an import error, a `python -m pretrain` that exits at once) show that
the copy, not the installed tree, is what the tests and their subprocesses run.

Importing this module does nothing (pytest does not collect it: it is not named test_*.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    edits: tuple[tuple[str, str], ...]  # (old, new): each old occurs exactly once in the file
    breaks: str  # what the change breaks, one line
    tests: tuple[str, ...]  # pytest node ids, cheapest and most likely killer first (-x stops at the first failure)
    k: str | None = None  # an optional -k expression over `tests`


def mutant(name: str, file: str, old: str, new: str, breaks: str, *tests: str, k: str | None = None,
           more: tuple[tuple[str, str], ...] = ()) -> Mutant:
    return Mutant(name, file, ((old, new), *more), breaks, tests, k)


TRAIN = "tests/test_train.py"
RUN_STATE = "tests/test_run_state.py"
CKPT = "tests/test_checkpoint.py"

MUTANTS = [
    # -- canaries: prove that the tests (in process and in their subprocesses) run the mutated copy
    mutant("canary-import", "pretrain/parallel/parallelize.py",
           "import functools\n", "import functools\nraise ImportError('mutation canary')\n",
           "pretrain.parallel.parallelize cannot be imported (in-process imports must load the copy)",
           "tests/test_parallelize.py::test_deepspeed_config_from_ours"),
    mutant("canary-subprocess", "pretrain/__main__.py",
           "from pretrain.cli import main\n", "sys.exit(97)\nfrom pretrain.cli import main\n",
           "`python -m pretrain` exits 97 at once (subprocesses must load the copy)",
           f"{TRAIN}::test_unknown_override_fails_fast_with_one_line"),

    # -- switches: a config field that must reach the code that acts on it
    mutant("compile", "pretrain/build.py",
           "    if cfg.train.compile:\n        apply_compile(engine, cfg.distributed.zero_stage)\n",
           "    if cfg.train.compile:\n        pass\n",
           "train.compile=true compiles nothing (apply_compile never called)",
           f"{TRAIN}::test_compile_trains_to_the_same_losses[0-fp32]"),
    mutant("activation-checkpointing", "pretrain/parallel/parallelize.py",
           "    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)\n",
           "",
           "train.activation_checkpointing is ignored: every activation is stored",
           f"{TRAIN}::test_switches_change_what_is_saved_for_backward"),
    mutant("loss-chunk", "pretrain/trainer.py",
           "loss = self.engine(inputs, labels, loss_chunk=self.cfg.train.loss_chunk_tokens, **extra)  # mean",
           "loss = self.engine(inputs, labels, loss_chunk=0, **extra)  # mean",
           "train.loss_chunk_tokens is not passed to the training forward (all logits at once)",
           f"{TRAIN}::test_switches_change_what_is_saved_for_backward"),
    mutant("clip-deepspeed", "pretrain/parallel/parallelize.py",
           "    clip = 0.0 if trainer_clips(cfg, precision) or muon_clips_itself(cfg, precision) else cfg.optimizer.grad_clip",
           "    clip = 0.0",
           "optimizer.grad_clip never reaches DeepSpeed: no clipping anywhere but ZeRO-0 fp32 (where the trainer clips)",
           "tests/test_parallelize.py::test_deepspeed_config_from_ours",
           f"{TRAIN}::test_zero_stage_0_trains_like_zero_3_with_clipping"),
    mutant("clip-stage0", "pretrain/trainer.py",
           "self.clip = cfg.optimizer.grad_clip if trainer_clips(cfg, precision) else 0.0",
           "self.clip = 0.0",
           "ZeRO stage 0 in fp32 (the trainer clips there) never clips",
           f"{TRAIN}::test_zero_stage_0_trains_like_zero_3_with_clipping"),
    mutant("grad-accum-dtype", "pretrain/parallel/parallelize.py",
           '           if precision == "bf16" else {}),',
           '           if False else {}),',
           "distributed.grad_dtype not written to the DeepSpeed config: bf16 runs accumulate and reduce in bf16",
           "tests/test_engine.py::test_zero3_bf16_trains_the_model_that_is_exported"),

    # -- optimizer and schedule
    mutant("weight-decay-groups", "pretrain/optim/optimizer.py",
           '"norm": {"lr_scale": 1.0, "eps": eps, "weight_decay": 0.0},',
           '"norm": {"lr_scale": 1.0, "eps": eps, "weight_decay": wd},',
           "norms and embeddings go back into the weight-decay group",
           "tests/test_parallelize.py::test_no_weight_decay_on_norms_and_embeddings",
           more=(('"weight_decay": wd if cfg.decay_embeddings else 0.0}', '"weight_decay": wd}'),)),
    mutant("warmup-off-by-one", "pretrain/optim/schedule.py",
           "        return peak * (step + 1) / warmup\n", "        return peak * step / warmup\n",
           "warmup starts at lr 0 (step s gets s/warmup of the peak, not (s+1)/warmup): step 1 learns nothing",
           "tests/test_parallelize.py::test_warmup_then_cosine_to_the_floor",
           f"{RUN_STATE}::test_skipped_steps_advance_the_schedule_and_log_the_rate_they_used"),
    mutant("warmup-off-by-one-wsd", "pretrain/optim/schedule.py",
           "            return self.peak * (step + 1) / self.warmup\n", "            return self.peak * step / self.warmup\n",
           "the same off-by-one in the WSD/constant schedules' warmup",
           "tests/test_scaling.py::test_wsd_warms_up_holds_then_decays_with_its_shape[linear-0.5]"),

    # -- data position
    mutant("data-position", "data_pipeline/loader.py",
           '        self._m = int(state["consumed"]) // self.world_size\n',
           '        self._m = int(state["consumed"]) // self.world_size + 1\n',
           "a resumed loader starts one sequence per rank past its saved position (data skipped)",
           "tests/data_pipeline/test_resume.py::test_exact_resume_three_times[no-shuffle]",
           "tests/data_pipeline/test_resume.py::test_world_size_change[3 files-0]"),

    # -- checkpoints
    mutant("checksum-skipped", "pretrain/checkpoint/layout.py",
           '        if sha256(path) != want["sha256"]:\n', "        if False:\n",
           "the sha256 of a checkpoint's files is never compared with its manifest (bit flips load)",
           f"{RUN_STATE}::test_export_and_generate_verify_the_checkpoint_first[flip]",
           f"{CKPT}::test_flipped_bytes_fail_the_checksum"),
    mutant("reader-unverified", "pretrain/checkpoint/layout.py",
           "    problem = check_files(ckpt)\n", "    problem = None\n",
           "export/generate/eval open a checkpoint without verifying it against its manifest",
           f"{RUN_STATE}::test_export_and_generate_verify_the_checkpoint_first[flip]"),
    mutant("resume-unverified", "pretrain/checkpoint/manager.py",
           "check_files(ckpt, self.env.rank, self.env.world_size)) if p]", "None) if p]",
           "resume (and init_from) never verify a checkpoint: a broken one is resumed from",
           f"{CKPT}::test_rotation_and_interrupted_saves"),
    mutant("resume-without-optimizer", "pretrain/checkpoint/manager.py",
           "load_optimizer_states=True,", "load_optimizer_states=False,",
           "a resume restores the weights but not the Adam moments: not an exact resume",
           f"{RUN_STATE}::test_resume_from_an_older_checkpoint_does_not_repeat_steps"),
    mutant("universal-hyperparameters", "pretrain/checkpoint/manager.py",
           "            group.update(saved)\n", "            pass\n",
           "a resume at another world size keeps DeepSpeed's universal-loader bug: weight decay on norms and embeddings",
           f"{CKPT}::test_resume_at_another_world_size[2-1]"),
    mutant("universal-shared-step", "pretrain/checkpoint/manager.py",
           'state["step"] = state["step"].clone().to(', 'state["step"] = state["step"].to(',
           "a resume at another world size shares one Adam `step` tensor between groups (counted twice a step)",
           f"{CKPT}::test_resume_at_another_world_size[2-1]"),

    # -- model
    mutant("rope-table", "pretrain/parallel/parallelize.py",
           "        model.reset_rope_table()  # zero.Init built it in bf16 (its patched constructors)\n", "",
           "under ZeRO-3 + bf16 the RoPE table stays bf16 (positions past 256 rounded)",
           "tests/test_engine.py::test_zero3_bf16_trains_the_model_that_is_exported"),
    mutant("tied-init-draws-head", "pretrain/model/model.py",
           "            if not self.args.tie_embeddings:\n                nn.init.normal_(self.output.weight",
           "            if True:\n                nn.init.normal_(self.output.weight",
           "a tied head is drawn again after the blocks, replacing the embedding's initialisation",
           "tests/model/test_model_init.py::test_tied_init_draws_the_embedding_once"),
    mutant("rmsnorm-eps", "pretrain/model/norm.py",
           "F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)", "F.rms_norm(x.float(), (x.size(-1),), eps=None)",
           "RMSNorm ignores model.norm_eps (torch's default eps): logits drift from HF Llama's",
           "tests/model/test_hf.py::test_logits_match_hf[gqa-eager]"),
    mutant("swiglu-gate-up-swapped", "pretrain/model/feedforward.py",
           "return self.w2(self.glu(self.w1(x), self.w3(x)))", "return self.w2(self.glu(self.w3(x), self.w1(x)))",
           "SwiGLU gates with w3 instead of w1 (HF's gate/up swapped): not HF Llama",
           "tests/model/test_hf.py::test_logits_match_hf[gqa-eager]"),

    # -- resilience
    mutant("compute-clock-no-hooks", "pretrain/faults/stragglers.py",
           "self.handles = [h for m in timed for h in", "self.handles = [h for m in timed[:0] for h in",
           "the straggler report's compute clock registers no hooks: a slow device is never named",
           "tests/test_resilience.py::test_a_slow_device_is_found_by_its_compute_time[3]"),
    mutant("spikes-never-found", "pretrain/faults/spikes.py",
           "        if not self.sigma or len(self.losses) < self.warmup:\n            return \"\"\n",
           "        if True:\n            return \"\"\n",
           "spike detection is off (Spikes.check always answers no spike)",
           "tests/test_resilience.py::test_a_spike_is_skipped_and_the_resume_decides_the_same"),
    mutant("hang-request-ignored", "pretrain/faults/watchdog.py",
           "                if latest > self.handled:\n                    self._report(idle, fired=False, g=latest)\n",
           "                if False:\n                    self._report(idle, fired=False, g=latest)\n",
           "a watchdog answers a hang report only when its own timer fires: a healthy rank still making "
           "progress through its micro-batches is named as frozen",
           "tests/test_resilience.py::test_a_hang_names_the_hung_rank_even_when_the_others_fire_later"),
    mutant("eval-marks-no-progress", "pretrain/trainer.py",
           "            for batch in self.val_batches:\n                self._progress()\n",
           "            for batch in self.val_batches:\n",
           "an evaluation longer than the hang timeout is killed as a hang",
           "tests/test_resilience.py::test_long_phases_that_make_progress_are_not_hangs"),
    mutant("rollback-ledger-not-durable", "pretrain/faults/spikes.py",
           "        if self.is_main:\n            from pretrain.checkpoint.rundir import write_atomic\n",
           "        if False:\n            from pretrain.checkpoint.rundir import write_atomic\n",
           "a rollback's data skip is forgotten when the run dies before its next checkpoint",
           "tests/test_resilience.py::test_a_rollback_survives_a_kill_before_its_next_checkpoint"),
    mutant("rotation-forgets-rollback-target", "pretrain/checkpoint/manager.py",
           "        first_spike = self.pinned()\n", "        first_spike = None\n",
           "rotation deletes the checkpoint a rollback needs",
           "tests/test_resilience.py::test_rotation_keeps_the_checkpoint_a_rollback_needs"),
    mutant("load-universal-sticky", "pretrain/checkpoint/manager.py",
           "        engine._config.load_universal_checkpoint = universal\n",
           "        engine._config.load_universal_checkpoint = engine._config.load_universal_checkpoint or universal\n",
           "after a resume at another world size every later restore (a decay branch) loads as universal",
           "tests/test_resilience.py::test_a_decay_branch_after_a_resume_at_another_world_size"),
    mutant("fault-marker-ignores-step", "pretrain/faults/inject.py",
           'marker = self.markers / f"{f.kind}@step={step}-rank{self.rank}"',
           'marker = self.markers / f"{f.kind}-rank{self.rank}"',
           "a second drill of the same kind at another step silently does nothing",
           "tests/test_resilience.py::test_a_drill_at_another_step_fires_and_nan_hits_every_micro_batch"),
    mutant("nonfinite-update-applied", "pretrain/trainer.py",
           '# stop: raises\n                return None\n', '# stop: raises\n                return step(*args, **kwargs)\n',
           "a step dropped as non-finite (loss or gradient norm) still updates the weights",
           f"{RUN_STATE}::test_skipped_steps_advance_the_schedule_and_log_the_rate_they_used",
           f"{TRAIN}::test_nonfinite_loss_skip_leaves_weights_untouched",
           f"{RUN_STATE}::test_an_overflow_with_a_finite_loss_stops_and_keeps_the_checkpoint[0]",
           more=(("                self._grad_nonfinite = True\n                return None\n",
                  "                self._grad_nonfinite = True\n                return step(*args, **kwargs)\n"),)),
    mutant("nonfinite-norm-unchecked", "pretrain/trainer.py",
           "if not math.isfinite(norm_value) or norm_value < 0:", "if False:",
           "the guard no longer checks the gradient norm: a finite loss with inf gradients is applied (stage 0)",
           f"{RUN_STATE}::test_an_overflow_with_a_finite_loss_stops_and_keeps_the_checkpoint[0]"),

    # -- muP / CompleteP
    mutant("mup-lr-scale-ignored", "pretrain/optim/optimizer.py",
           'group["lr"] = lr * group.get("lr_scale", 1.0)', 'group["lr"] = lr',
           "the trainer gives every group the base rate: muP's hidden matrices train at lr, not lr / m",
           "tests/test_mup.py::test_the_groups_rates_reach_the_optimizer_on_the_users_path_and_after_a_resume"),
    mutant("mup-eps-unscaled", "pretrain/optim/optimizer.py",
           '"lr_scale": 1.0 / m, "eps": eps / (m * m_depth),', '"lr_scale": 1.0 / m, "eps": eps,',
           "muP's hidden matrices keep the base Adam epsilon",
           "tests/model/test_parametrization.py::test_optimizer_groups",
           "tests/test_mup.py::test_the_groups_eps_and_decay_are_in_the_saved_optimizer_state"),
    mutant("mup-logits-unscaled", "pretrain/model/model.py",
           "            h = h * self.logit_scale\n", "            h = h\n",
           "muP's output logits are not multiplied by 1/m",
           "tests/model/test_parametrization.py::test_folded_export_gives_our_logits_in_hf",
           "tests/test_mup.py::test_coordinate_check_across_width"),
    mutant("completep-branches-unscaled", "pretrain/model/model.py",
           "        self.residual_scale = args.residual_scale  # completep: 1 / m_L on each branch\n",
           "        self.residual_scale = 1.0\n",
           "CompleteP's residual branches are not multiplied by 1/m_L",
           "tests/model/test_parametrization.py::test_folded_export_gives_our_logits_in_hf",
           "tests/test_mup.py::test_coordinate_check_across_depth"),
    mutant("mup-hidden-init-unscaled", "pretrain/model/model.py",
           "                block.init_weights(hidden_std, out_std, self.args.ffn_out_init_std, std)",
           "                block.init_weights(std, out_std, self.args.ffn_out_init_std, std)",
           "muP's hidden matrices are drawn at the base std at every width",
           "tests/model/test_parametrization.py::test_init_follows_the_parametrization"),
    mutant("mup-parametrization-unchecked", "pretrain/checkpoint/manager.py",
           "        if saved_p != ours_p:", "        if False:",
           "a resume (or fine-tune) under another parametrization is not refused",
           "tests/test_mup.py::test_a_resume_with_another_parametrization_is_refused"),

    # -- evaluation and scaling
    mutant("bits-per-byte-in-nats", "pretrain/eval/evaluate.py",
           '"bits_per_byte": loss_sum / (math.log(2) * n_bytes) if n_bytes',
           '"bits_per_byte": loss_sum / n_bytes if n_bytes',
           "pretrain eval reports bits per byte in nats per byte",
           "tests/test_evaluate.py::test_micro_batch_size_changes_nothing_but_the_batching[2]",
           "tests/test_continued_pretraining.py::test_eval_equals_the_runs_own_eval_at_any_world_size_and_its_export"),
    mutant("by-position-not-reduced", "pretrain/eval/evaluate.py",
           "    reduced = distributed.host_sum(sums.tolist() + buckets.flatten().tolist())",
           "    reduced = distributed.host_sum(sums.tolist()) + buckets.flatten().tolist()",
           "pretrain eval --by-position under torchrun gives rank 0's buckets, not the sums over ranks",
           "tests/test_context_extension.py::test_by_position_is_the_same_at_one_and_two_ranks_and_a_bad_width_is_one_line"),
    mutant("hf-rope-refused", "pretrain/build.py",
           '"head_dim": "head_size", **{f: f for f in RECIPE_FIELDS if f != "head_size"}}',
           '"head_dim": "head_size", "rope_theta": "rope_theta", **{f: f for f in RECIPE_FIELDS if f != "head_size"}}',
           "continuing a Hugging Face model with a larger model.rope_theta is refused (context extension)",
           "tests/test_context_extension.py::test_a_hugging_face_model_may_be_continued_with_other_rope_settings"),
    mutant("scaling-optimum-exponent", "pretrain/scaling/fit.py",
           "    n = g * (budget / 6) ** (beta / (alpha + beta))\n", "    n = g * (budget / 6) ** (alpha / (alpha + beta))\n",
           "the compute-optimal N* grows as C^(alpha/(alpha+beta)) instead of C^(beta/(alpha+beta))",
           "tests/test_scaling.py::test_isoflop_fit_recovers_the_optimal_exponents",
           "tests/test_scaling.py::test_parametric_fit_recovers_a_known_law"),
    # -- sequence parallelism and document masking (#31)
    mutant("sp-local-attention", "pretrain/parallel/ulysses.py",
           "    return exchange(q, k, v, 0, None, mask, sinks)", "    return local(q, k, v, mask, sinks)",
           "each rank attends only over its own slice of the sequence (no all-to-all)",
           "tests/test_sequence_parallel.py::test_a_sequence_parallel_group_computes_what_one_process_does[2-2]"),
    mutant("sp-loss-per-rank-mean", "data_pipeline/documents.py",
           '"label_count": (labels != -100).sum().item() / size}',
           '"label_count": (labels[:, part] != -100).sum().item()}',
           "each rank's loss is the mean of its own slice: the group's loss a mean of the ranks' means",
           "tests/test_sequence_parallel.py::test_a_sequence_parallel_group_computes_what_one_process_does[2-2]"),
    mutant("sp-positions-not-offset", "data_pipeline/documents.py",
           "        positions = torch.arange(rank * n, (rank + 1) * n).expand(B, n)",
           "        positions = torch.arange(0, n).expand(B, n)",
           "RoPE positions of a slice start at 0 instead of where the slice sits in the sequence",
           "tests/test_sequence_parallel.py::test_a_sequence_parallel_group_computes_what_one_process_does[2-2]"),
    mutant("mlp-tiles", "pretrain/parallel/parallelize.py",
           "        block.feed_forward.chunk = cfg.train.mlp_chunk_tokens", "        block.feed_forward.chunk = 0",
           "train.mlp_chunk_tokens is ignored: the MLP runs in one piece",
           "tests/test_sequence_parallel.py::test_mlp_tiles_compute_the_same_and_keep_only_their_inputs"),
    mutant("document-mask-nothing", "pretrain/model/attention.py",
           "    return (documents[:, None, :, None] == documents[:, None, None, :]) & keep",
           "    return keep.expand(B, 1, T, T)",
           "model.document_mask=true masks nothing beyond causality",
           "tests/test_sequence_parallel.py::test_document_masking_scores_like_each_document_alone_in_one_process"),
    # -- Muon (#32)
    mutant("muon-ignored", "pretrain/optim/optimizer.py",
           '    if cfg.name == "muon":\n', '    if False:\n',
           "optimizer.name=muon is ignored: every weight trains with AdamW (DeepSpeed #8438's failure)",
           "tests/test_muon.py::test_muon_steps_as_torch_muon_does"),
    mutant("muon-clips-updates", "pretrain/parallel/parallelize.py",
           "    zero._apply_muon_to_accumulated_grads = clip_then_apply", "    pass",
           "DeepSpeed's own clipping at ZeRO-3: the Muon updates clipped, not the gradients",
           "tests/test_muon.py::test_muon_steps_as_torch_muon_does[3-2-0.3-1]"),
    mutant("muon-zero12-clips-updates", "pretrain/parallel/parallelize.py",
           "    zero.scaled_global_norm = clip_then_orthogonalise", "    zero.scaled_global_norm = norm",
           "at ZeRO-1/2 the norm is over the Muon updates and nothing is clipped before Newton-Schulz",
           "tests/test_muon.py::test_muon_steps_as_torch_muon_does[1-2-0.3-1]"),
    mutant("muon-dropped-momentum", "pretrain/parallel/parallelize.py",
           "        if saved and not ran[0]:", "        if False:",
           "a dropped update still moves Muon's momentum",
           "tests/test_muon.py::test_a_dropped_update_leaves_the_momentum[3-fp32]"),
    mutant("muon-bf16-dropped-momentum", "pretrain/parallel/parallelize.py",
           "    opt._prepare_muon_updates = lambda: None\n", "",
           "DeepSpeed's bf16 optimizer (bf16 at ZeRO-0/1) still moves Muon's momentum on a dropped update",
           "tests/test_muon.py::test_a_dropped_update_leaves_the_momentum[0-bf16]"),
    mutant("muon-mup-rate", "pretrain/optim/optimizer.py",
           '    if args.parametrization == "sp":\n        return None', '    if True:\n        return None',
           "under muP/CompleteP Muon takes sp's rate, 0.2 sqrt(fan_in), which grows with width",
           "tests/test_muon.py::test_muon_rates_under_mup_follow_the_spectral_condition",
           "tests/test_mup.py::test_coordinate_check_with_muon_across_width"),
    mutant("muon-one-owner", "pretrain/estimate/muon.py",
           "        out[j] = min(range(n), key=lambda r: (load[r], r))", "        out[j] = 0",
           "rank 0 orthogonalises every matrix (DeepSpeed's per-bucket round robin at its default bucket)",
           "tests/test_muon.py::test_muon_step_spreads_newton_schulz_and_sends_its_share"),
    mutant("muon-rate-rule", "pretrain/optim/optimizer.py",
           "    return 0.2 * math.sqrt(base_in * min(1, fan_out / fan_in) / min(1, base_out / base_in))",
           "    return 1.0",
           "Muon's rate is DeepSpeed's own (no match_adamw factor): AdamW's rate does not carry over",
           "tests/test_muon.py::test_rate_rule_matches_torch_match_rms_adamw",
           "tests/test_muon.py::test_muon_steps_as_torch_muon_does"),
    # -- Parallel layouts (#33)
    mutant("tp-replicates", "pretrain/parallel/parallelize.py",
           '        **({"tensor_parallel": tensor_parallel_config(d.tensor_parallel)} if d.tensor_parallel > 1 else {}),\n',
           "",
           "distributed.tensor_parallel replicates the matrices instead of splitting them (AutoTP never set up)",
           "tests/test_tensor_parallel.py::test_each_rank_holds_its_slice_of_the_tp1_weights"),
    mutant("tp-merge-first-slice", "pretrain/checkpoint/reshard.py",
           "    return slices[0] if dim is None or len(slices) == 1 else torch.cat(slices, dim=dim)",
           "    return slices[0]",
           "a tensor-parallel checkpoint consolidates to tensor-parallel rank 0's slices",
           "tests/test_tensor_parallel.py::test_tp2_by_dp2_on_four_ranks_trains_resumes_and_evaluates_as_tp1"),
    # -- the new axes on every path (tensor and sequence parallelism, document masking)
    mutant("tp-norm-per-rank", "pretrain/parallel/parallelize.py",
           "    total = distributed.all_reduce(sliced, group=distributed.tensor_group())\n",
           "    total = sliced\n",
           "ZeRO stage 0 under tensor parallelism clips with this rank's slices' norm, not the model's",
           "tests/test_tensor_parallel.py::test_tensor_parallel_at_each_zero_stage_equals_tp1[0-fp32-1e-06]"),
    mutant("tp-consolidate-rank-0", "pretrain/checkpoint/reshard.py",
           '    slices = [read_shards(ckpt, t, keys=("fp32",))[0] for t in ranks]',
           '    slices = [read_shards(ckpt, t, keys=("fp32",))[0] for t in ranks[:1]]',
           "a tensor-parallel checkpoint below ZeRO-3 reads as tensor-parallel rank 0's half matrices",
           "tests/test_tensor_parallel.py::test_tensor_parallel_at_each_zero_stage_equals_tp1[1-fp32-1e-06]"),
    mutant("tp-init-from-rank-0", "pretrain/checkpoint/weights.py",
           "                    if env.tp > 1:  # (ranks 0 .. tp-1: the first tensor-parallel group)\n"
           "                        distributed.broadcast(value, group=distributed.tensor_group())\n",
           "",
           "checkpoint.init_from into tensor parallelism at ZeRO-3 loads only tensor-parallel rank 0's slices",
           "tests/test_tensor_parallel.py::test_tensor_parallel_at_each_zero_stage_equals_tp1[3-bf16-0.005]"),
    mutant("hf-drops-document-mask", "pretrain/build.py",
           "for f in ROPE_FIELDS + MASK_FIELDS + LOSS_FIELDS", "for f in ROPE_FIELDS + LOSS_FIELDS",
           "continuing a Hugging Face model trains without the document mask the run config sets",
           "tests/test_continued_pretraining.py::test_continuing_keeps_the_document_masking_the_run_config_sets"),
    mutant("resume-switches-masking", "pretrain/checkpoint/layout.py",
           '"rope_local_scaling", "document_mask",\n                   "document_positions", "eot_id")',
           '"rope_local_scaling")',
           "a resume may switch document masking on or off",
           f"{CKPT}::test_a_resume_that_switches_document_masking_is_refused"),
    mutant("muon-momentum-lost-zero3", "pretrain/checkpoint/reshard.py",
           '            state["momentum_buffer"] = state.pop("exp_avg")\n',
           '            state["momentum_buffer"] = state.pop("exp_avg").zero_()\n',
           "a Muon run resumed at another world size at ZeRO-3 restarts its momentum from zero",
           "tests/test_muon.py::test_muon_checkpoints_resume_bitwise_and_refuse_what_they_cannot"),
    mutant("muon-momentum-lost-zero12", "pretrain/checkpoint/reshard.py",
           "                state[\"momentum_buffer\"] = torch.cat(parts).to(flat.device, flat.dtype)",
           "                state[\"momentum_buffer\"] = torch.cat(parts).to(flat.device, flat.dtype).zero_()",
           "a Muon run resumed at another world size at ZeRO-1/2 restarts its momentum from zero",
           "tests/test_reshard.py::test_a_run_resumes_at_another_world_size[muon-1-fp32-2-1]"),
    mutant("task-check-no-progress", "pretrain/eval/tasks/scoring.py",
           "                if progress is not None and n % 64 == 0:\n                    progress()\n", "",
           "checking thousands of task requests marks no progress: a short hang timeout kills the evaluation",
           "tests/test_tasks.py::test_checking_thousands_of_requests_is_progress_the_hang_watchdog_sees"),
    mutant("hang-listener-polls", "pretrain/faults/watchdog.py",
           "                ear.wait_call(g, self.rank, LISTEN_S)\n",
           "                ear.wait_call(g, self.rank, 0.5)\n",
           "every watchdog asks the rendezvous store twice a second whether a report was called (8,192 requests/s at 4,096 ranks)",
           "tests/test_hang_store.py::test_waiting_watchdogs_send_the_store_nothing"),
    mutant("tokens-per-rank", "pretrain/trainer.py",
           "        if self.env.rank % self.env.group_size:", "        if False:",
           "data/tokens/* count a sequence once per rank of the sequence-parallel group that reads it",
           "tests/test_sequence_parallel.py::test_sequence_parallel_training_equals_one_rank[fp32-0-extra3-1e-06]"),
    mutant("hpz-ignored", "pretrain/parallel/parallelize.py",
           '        zero["zero_hpz_partition_size"] = local_size', "        pass",
           "distributed.hpz=true is ignored: every ZeRO-3 gather crosses nodes",
           "tests/test_hpz.py::test_hpz_trains_exactly_as_zero3_with_its_gathers_inside_the_node"),
    # -- Mixture-of-Experts (#39)
    mutant("moe-local-counts", "pretrain/parallel/parallelize.py",
           "        layer.reduce_counts = distributed.all_reduce", "        layer.reduce_counts = None",
           "each rank's balancing loss counts its own tokens, not the global batch's",
           "tests/test_moe_training.py::test_two_ranks_train_as_one_with_the_balance_counted_over_the_global_batch"),
    mutant("moe-aux-dropped", "pretrain/model/model.py",
           "        return out + torch.stack(aux).sum() if aux else out", "        return out",
           "model.moe_aux_loss and moe_z_loss are ignored: the router is never balanced",
           "tests/model/test_moe.py::test_the_training_loss_adds_each_moe_blocks_aux_loss_and_eval_does_not"),
    mutant("moe-bias-frozen", "pretrain/model/moe.py",
           "        if applied and self.bias_rate:", "        if False:",
           "model.moe_bias_rate is ignored: the DeepSeek-V3 bias never moves",
           "tests/test_moe_training.py::test_moe_trains_on_the_users_path_with_its_metrics"),
    mutant("moe-bias-not-loaded", "pretrain/checkpoint/weights.py",
           "            buffer.copy_(value)", "            pass",
           "fine-tuning from an MoE checkpoint starts the routers' biases at zero",
           "tests/test_moe_training.py::test_fine_tuning_from_an_moe_checkpoint_carries_its_routers_biases"),
    mutant("moe-bias-weights", "pretrain/model/moe.py",
           "        weights = scores.gather(1, chosen)", "        weights = (scores + self.expert_bias).gather(1, chosen)",
           "the bias changes the experts' weights, not only which are chosen",
           "tests/model/test_moe.py::test_the_sigmoid_router_and_the_bias_only_select"),
    mutant("ep-not-sharded", "pretrain/build.py",
           "        shard_experts(model, env, zero3=cfg.distributed.zero_stage == 3)", "        pass",
           "distributed.expert_parallel is ignored: every rank holds and gathers every expert",
           "tests/test_moe_training.py::test_expert_parallelism_trains_as_every_rank_holding_every_expert"),
    mutant("ep-gradient-average", "pretrain/parallel/expert_parallel.py",
           '                p.ds_zero_placement_family = "autoep_expert"\n', "",
           "an expert's gradient is averaged over the ranks that hold it, not the world (twice too large at 4 ranks, ep 2)",
           "tests/test_moe_training.py::test_expert_parallelism_trains_as_every_rank_holding_every_expert"),
    mutant("ep-zero12-engine-not-told", "pretrain/parallel/parallelize.py",
           "    with engine_with_experts(marked(model)):", "    with engine_with_experts(False):",
           "at ZeRO-1/2 DeepSpeed is not told of the experts: their groups are not its MoE groups",
           "tests/test_moe_training.py::test_expert_parallelism_at_zero_1_and_2_trains_as_every_rank_holding_every_expert"),
    mutant("ep-zero12-weights-of-rank-0", "pretrain/checkpoint/manager.py",
           "                expert_parallel.from_master_weights(engine)", "                pass",
           "a resume at ZeRO-1/2 under expert parallelism gives every rank rank 0's experts (the model states file's)",
           "tests/test_moe_training.py::test_expert_parallelism_on_the_users_path_at_zero_1"),
    mutant("ep-zero12-read-in-rank-order", "pretrain/checkpoint/reshard.py",
           "            ep = _expert_parallel_size(first[\"base_optimizer_state\"][\"param_groups\"][g])",
           "            ep = 1",
           "the experts' ZeRO-1/2 shards are joined in rank order: the whole model read back mixes experts",
           "tests/test_moe_training.py::test_expert_parallelism_at_zero_1_and_2_trains_as_every_rank_holding_every_expert"),
    mutant("ep-zero12-groups-not-padded", "pretrain/checkpoint/reshard.py",
           '    common["param_groups"] = info["param_groups"] * 2', '    common["param_groups"] = info["param_groups"]',
           "a resume at expert_parallel > 1 at ZeRO-1/2 from a checkpoint without keeps the experts as initialised",
           "tests/test_moe_training.py::test_expert_parallelism_at_zero_1_and_2_trains_as_every_rank_holding_every_expert"),
    mutant("muon-experts-on-adamw", "pretrain/optim/optimizer.py",
           "            p.use_muon = len(shape) in (2, 3) and role(names[p], len(shape)) in MUON_ROLES",
           "            p.use_muon = len(shape) == 2 and role(names[p], len(shape)) in MUON_ROLES",
           "optimizer.name=muon leaves an MoE layer's stacked experts to AdamW",
           "tests/test_muon.py::test_muon_steps_each_expert_as_torch_muon_steps_a_matrix[0-1]"),
    mutant("universal-buffers", "pretrain/checkpoint/reshard.py",
           "            buffer.copy_(module[name])", "            pass",
           "a resume at another layout starts the routers' biases at zero (DeepSpeed's universal load skips buffers)",
           "tests/test_moe_training.py::test_two_ranks_train_as_one_with_the_balance_counted_over_the_global_batch"),
    mutant("fp8-not-converted", "pretrain/build.py",
           "        convert(model, cfg.train.fp8_recipe, cfg.train.fp8_emulate)", "        pass",
           "train.precision=fp8 trains in plain bf16 (the linears left as nn.Linear)",
           "tests/test_fp8.py::test_fp8_trains_on_the_users_path_and_says_what_it_converted",
           "tests/test_fp8.py::test_100_fp8_steps_stay_in_a_band_around_bf16s"),
    mutant("precision-change-not-universal", "pretrain/checkpoint/manager.py",
           "            universal = True  # (stages 1-3", "            universal = universal  # (stages 1-3",
           "a resume at another precision (bf16 <-> fp32, ZeRO 1-3) looks for optimizer files named for its own",
           "tests/test_fp8.py::test_an_fp8_checkpoint_resumes_in_bf16_and_fp32[fp32]"),
    mutant("ep-empty-rank-off-the-graph", "pretrain/model/moe.py",
           "        busy = [e for e, n in enumerate(sizes) if n] or [0]\n",
           "        busy = [e for e, n in enumerate(sizes) if n]\n        if not busy:\n            return x.new_zeros(0, "
           "x.size(1)) + 0 * sum(w.sum() for w in (self.w1, self.w2, self.w3)).to(x.dtype)\n",
           "a rank whose experts get no token skips the dispatch all-to-all's backward: the others wait in it (a hang)",
           "tests/test_expert_parallel.py::test_a_rank_whose_experts_get_no_token_trains_as_one_holding_every_expert"),
    mutant("start-changes-the-run-dir-before-its-checks", "pretrain/checkpoint/manager.py",
           "        start.run_id = distributed.broadcast_object(start.run_id)\n        return start\n",
           "        start.run_id = distributed.broadcast_object(start.run_id)\n        self.begin(start)\n        return start\n",
           "a start refused by a later check has already set newer checkpoints aside and rewritten latest and run.json",
           "tests/test_run_state.py::test_resume_from_an_older_checkpoint_does_not_repeat_steps"),
    mutant("hf-model-left-unchecked", "pretrain/config.py",
           "        problems = self.problems(world_size)",
           "        problems = self.problems(world_size, model=not is_hf_model(self.checkpoint.init_from))",
           "the start's checks skip the model of a Hugging Face init_from: a Mixtral takes what an MoE refuses",
           "tests/test_continued_pretraining.py::test_an_hf_mixtral_gets_the_checks_of_a_native_moe"),
    mutant("hf-config-shape-unchecked", "pretrain/hf/mapping.py",
           "    problems = args.problems()  # (a shape the model cannot take", "    problems = []  # (a shape the model cannot take",
           "a config.json the model cannot take (num_experts_per_tok > num_local_experts) ends in a traceback",
           "tests/test_continued_pretraining.py::test_a_mixtral_config_the_model_cannot_take_is_one_line"),
    mutant("branch-spikes-not-rolled-back", "pretrain/trainer.py",
           "                if self._rolled_back(newest=start):  # (to this step: the branch starts over)\n",
           "                if False:  # (to this step: the branch starts over)\n",
           "spikes in a WSD-S decay branch are dropped but never rolled back: the branch applies fewer updates",
           "tests/test_resilience.py::test_spikes_in_a_decay_branch_roll_back_within_it"),
    mutant("branch-counts-stable-spikes", "pretrain/trainer.py",
           "        self.rollbacks.recent_spikes = []  # the stable phase's: they would roll back to before the branch\n",
           "",
           "the stable phase's recent spikes count in a decay branch: a rollback targets a checkpoint before the branch",
           "tests/test_resilience.py::test_spikes_in_a_decay_branch_roll_back_within_it"),
    mutant("branch-averages-dropped-steps", "pretrain/trainer.py",
           "                if self.dropped:\n                    dropped += 1\n                else:\n                    losses.append(loss)\n",
           "                losses.append(loss)\n",
           "a decay branch's record averages dropped (spike) losses in and says 0 steps were dropped",
           "tests/test_resilience.py::test_spikes_in_a_decay_branch_roll_back_within_it"),
    mutant("fit-takes-dropped-branch", "pretrain/scaling/results.py",
           '            if r.get("branch/dropped_steps"):', "            if False:",
           "`pretrain scaling fit` takes a decay branch that dropped updates as a point of the law",
           "tests/test_scaling.py::test_a_decay_branch_that_dropped_updates_is_refused_by_the_fit"),
    mutant("config-nonfinite-passes", "pretrain/config.py",
           "        bad = non_finite(self)\n", "        bad = []\n",
           "NaN or inf in a config field (model.moe_bias_rate=nan, a source's weight=inf) passes the config check and trains",
           "tests/test_config.py::test_nan_and_inf_are_refused_in_every_float_field_in_one_line"),
    mutant("eot-id-outside-the-vocabulary", "pretrain/model/args.py",
           "if self.eot_id < -1 or self.vocab_size and self.eot_id >= self.vocab_size:", "if self.eot_id < -1:",
           "model.eot_id outside the vocabulary trains as if there were no document mask",
           "tests/test_config.py::test_a_nan_coefficient_and_an_eot_id_outside_the_vocabulary_stop_a_run_before_it_starts"),
    mutant("resume-moe-shape-unchecked", "pretrain/checkpoint/layout.py",
           '"tie_embeddings") \\\n    + MOE_SHAPE_FIELDS + RECIPE_SHAPE_FIELDS\n', '"tie_embeddings") + RECIPE_SHAPE_FIELDS\n',
           "a resume with another moe_experts/moe_hidden_dim/moe_shared_experts/moe_dense_layers reaches "
           "load_state_dict (size-mismatch traceback)",
           "tests/test_checkpoint_manager.py::test_a_resume_with_another_moe_shape_or_routing_is_refused_in_one_line",
           "tests/test_moe_training.py::test_a_resume_with_another_moe_shape_or_routing_is_one_line"),
    mutant("resume-moe-routing-unchecked", "pretrain/checkpoint/layout.py",
           '"eot_id") \\\n    + MOE_FUNCTION_FIELDS + RECIPE_FUNCTION_FIELDS\n', '"eot_id") + RECIPE_FUNCTION_FIELDS\n',
           "a resume with another moe_top_k, moe_router or moe_norm_topk is taken silently",
           "tests/test_checkpoint_manager.py::test_a_resume_with_another_moe_shape_or_routing_is_refused_in_one_line"),
    mutant("mup-check-precision-unchecked", "pretrain/mup.py",
           "    precision = resolve_precision(cfg, device)\n", '    precision = "fp32"\n',
           "`pretrain mup check` measures an fp32 model for a precision `pretrain train` refuses (fp8 on a CPU), exit 0",
           "tests/test_mup.py::test_coordinate_check_refuses_the_precision_train_refuses_in_its_line"),
    mutant("tp-compile-traces-batch-check", "pretrain/parallel/parallelize.py",
           "        eager_batch_check(engine)\n", "",
           "compile with tensor parallelism at ZeRO 0-2 traces DeepSpeed's per-rank batch check: the ranks' "
           "collectives stop lining up and gloo aborts",
           "tests/test_tensor_parallel.py::test_compiled_tensor_parallel_at_zero_0_to_2_trains_as_eager[1]"),
    # -- the per-layer description (#50)
    mutant("qk-norm-head-skipped", "pretrain/model/attention.py",
           "        if self.qk_norm == \"head\":  # each head's vector alone (Qwen3, Gemma 3)\n            q, k = self.q_norm(q), self.k_norm(k)\n",
           "",
           "model.qk_norm=head builds the norms and never applies them",
           "tests/model/test_recipes.py::test_each_option_computes_its_definition[qk_norm_head]"),
    mutant("post-norm-ignored", "pretrain/model/model.py",
           "        h = x + a if self.residual_scale == 1.0 else x + self.residual_scale * a\n",
           "        h = x + self.attention(self.attention_norm(x), freqs_cis, cache_k, cache_v, start_pos, mask)\n",
           "model.norm_placement=post leaves the attention's output unnormalised",
           "tests/model/test_recipes.py::test_each_option_computes_its_definition[post_norm]"),
    mutant("window-ignored", "pretrain/model/attention.py",
           "    return keep & (q - kv < window) if window else keep\n\n\n@functools",
           "    return keep\n\n\n@functools",
           "local layers attend to the whole past (the window is ignored on the CPU path)",
           "tests/model/test_recipes.py::test_each_option_computes_its_definition[sliding_window]",
           "tests/model/test_recipes.py::test_generation_past_the_window_equals_the_full_forward"),
    mutant("nope-layer-rotated", "pretrain/model/args.py",
           "            return \"\"\n        return \"local\" if", "            pass\n        return \"local\" if",
           "model.nope_period: the NoPE layers are rotated anyway",
           "tests/model/test_recipes.py::test_each_option_computes_its_definition[nope_period]"),
    mutant("sinks-ignored", "pretrain/model/attention.py",
           "        out = self.attend(q, k, v, mask, self.sinks)  # (B, T, H, hd)",
           "        out = self.attend(q, k, v, mask, None)  # (B, T, H, hd)",
           "model.attn_sinks: the sink logits never enter the softmax",
           "tests/model/test_recipes.py::test_each_option_computes_its_definition[attn_sinks]"),
    mutant("embed-scale-dropped", "pretrain/model/model.py",
           "            h = h * self.args.embed_scale\n", "            pass\n",
           "model.embed_scale is ignored (Gemma's sqrt(dim) dropped)",
           "tests/model/test_recipes.py::test_each_option_computes_its_definition[embed_scale]"),
    mutant("z-loss-not-added", "pretrain/model/model.py",
           "        return (ce + z_loss * z) / divisor", "        return ce / divisor",
           "model.z_loss is logged but not added to the loss",
           "tests/model/test_recipes.py::test_the_z_loss_is_added_in_training_from_every_chunk_and_kept_apart"),
    mutant("gelu-tanh-is-silu", "pretrain/model/feedforward.py",
           '    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),', '    "gelu_tanh": F.silu,',
           "model.ffn_activation=gelu_tanh computes SwiGLU",
           "tests/model/test_recipes.py::test_each_option_computes_its_definition[gelu_tanh]"),
    mutant("hf-fold-q-scale-into-wq-under-qk-norm", "pretrain/hf/mapping.py",
           '    q_names = ("attention.q_norm.weight",) if args.qk_norm != "none" else ("attention.wq.weight", "attention.wq.bias")',
           '    q_names = ("attention.wq.weight", "attention.wq.bias")',
           "a muP/CompleteP export folds the attention multiplier into wq, where the q/k norm undoes it: HF's logits are not ours",
           "tests/model/test_hf_families.py::test_a_completep_model_exports_folded_into_its_family[qwen3]"),
    mutant("hf-fold-branch-under-post-norms", "pretrain/hf/mapping.py",
           '    branch_names = (("attention_out_norm.weight", "ffn_out_norm.weight") if args.norm_placement != "pre"',
           '    branch_names = (("attention_out_norm.weight", "ffn_out_norm.weight") if False',
           "CompleteP's residual multiplier folds into wo/w2, which OLMo 2's post-norms undo: the export's logits differ",
           "tests/model/test_hf_families.py::test_a_completep_model_exports_folded_into_its_family[olmo2]"),
    mutant("hf-family-off-fields-ignored", "pretrain/hf/mapping.py",
           "for key, (_, why) in family.off.items() if raw.get(key)]",
           "for key, (_, why) in family.off.items() if False]",
           "a family's config fields for what the model lacks (Qwen2 use_sliding_window, attention_bias) load silently",
           "tests/model/test_hf_families.py::test_what_a_family_has_and_we_lack_is_refused_in_one_line[qwen2-sliding-window]"),
    mutant("hf-head-dim-dropped", "pretrain/hf/mapping.py",
           "        head_size=0 if head_dim * heads == hidden else head_dim,",
           "        head_size=0,",
           "config.json's head_dim is ignored: a Qwen3 (head_dim != hidden/heads) gets the wrong head width",
           "tests/model/test_hf_families.py::test_import_gives_transformers_logits[qwen3]"),
    mutant("hf-start-drops-z-loss", "pretrain/build.py",
           "MASK_FIELDS + LOSS_FIELDS\n", "MASK_FIELDS + LOSS_FIELDS[:-1]\n",
           "model.z_loss is silently dropped when continuing a Hugging Face model (OLMo 2 trains with 1e-5)",
           "tests/test_context_extension.py::test_a_hugging_face_model_may_be_continued_with_other_rope_settings"),
    mutant("dense-mask-for-every-layer", "pretrain/model/attention.py",
           "        elif mask is None and (self.window or sinks is not None) and T > 1:\n",
           "        elif mask is None and T > 1:\n",
           "global layers take the dense-mask path on CPU: the same outputs, every T x T score computed and a T^2 mask kept per layer",
           "tests/test_estimate.py::test_a_window_changes_no_activation_but_the_cpu_paths_dense_mask"),
    mutant("estimate-local-layers-from-pattern", "pretrain/estimate/report.py",
           "    local = sum(bool(args.layer_window(i)) for i in range(args.n_layers))\n",
           "    local = args.layer_pattern.count(\"local\")\n",
           "pretrain estimate counts the pattern's local entries, not the local layers (3 of 32 instead of 24)",
           "tests/test_estimate.py::test_a_windowed_model_is_estimated_by_its_flops"),
    mutant("flops-window-as-full", "pretrain/model/model.py",
           "               for w in map(a.layer_window, range(a.n_layers)))", "               for w in [0] * a.n_layers)",
           "a local layer's attention FLOPs are counted as a global layer's: MFU and the estimate ignore the window",
           "tests/model/test_recipes.py::test_flops_count_a_local_layers_window_not_the_whole_sequence",
           "tests/test_estimate.py::test_a_windowed_model_is_estimated_by_its_flops"),
    mutant("sp-sinks-not-sliced", "pretrain/parallel/ulysses.py",
           "        sinks = sinks.chunk(size)[rank]", "        sinks = sinks.chunk(size)[0]",
           "under sequence parallelism every rank attends with the first rank's sinks, not those of its heads",
           "tests/test_recipes_training.py::test_two_ranks_and_ulysses_train_the_recipe_as_one_rank[sp]"),
    mutant("z-loss-in-train-loss", "pretrain/trainer.py",
           "                ce = ce - self.z_loss * z\n", "",
           "train/loss includes the output z-loss: the logged loss is not the cross-entropy",
           "tests/test_recipes_training.py::test_train_loss_is_the_cross_entropy_and_the_z_loss_is_logged"),
    mutant("z-loss-rank-0-only", "pretrain/trainer.py",
           "            z = distributed.all_reduce(torch.stack(self._z_losses).mean()) / self.env.world_size\n",
           "            z = torch.stack(self._z_losses).mean()\n",
           "train/z_loss is rank 0's own mean, not every rank's",
           "tests/test_recipes_training.py::test_train_loss_is_the_cross_entropy_and_the_z_loss_is_logged"),
    mutant("fp8-biased-linears-kept", "pretrain/model/float8.py",
           "    return type(module) is nn.Linear and module.in_features",
           "    return type(module) is nn.Linear and module.bias is None and module.in_features",
           "fp8: the biased linears (qkv_bias, attn_out_bias) stay in bf16",
           "tests/test_recipes_training.py::test_fp8_converts_the_biased_linears_and_leaves_norms_and_sinks"),
    mutant("resume-window-unchecked", "pretrain/checkpoint/layout.py",
           'f != "head_size" and f not in RECIPE_SHAPE_FIELDS)',
           'f != "head_size" and f not in RECIPE_SHAPE_FIELDS and f != "sliding_window")',
           "a resume with another model.sliding_window is taken silently",
           "tests/test_recipes_training.py::test_a_resume_that_changes_the_recipe_is_refused[function]"),
    mutant("attn-logits-future-key", "pretrain/metrics.py",
           "    keep = kv <= q\n    return keep & (q - kv < window) if window else keep\n",
           "    keep = kv <= q + 1\n    return keep & (q - kv < window) if window else keep\n",
           "logging.attn_logits counts each query's next (future) key as a kept pair",
           "tests/test_attn_logits.py::test_masked_pairs_are_ignored_and_kept_ones_found"),
    mutant("attn-logits-gqa-groups-swapped", "pretrain/metrics.py",
           "reshape(B, KV, G, T, hd)", "reshape(B, G, KV, T, hd).transpose(1, 2)",
           "logging.attn_logits pairs query head h with KV head h % KV instead of h // group (GQA)",
           "tests/test_attn_logits.py::test_maxima_equal_the_dense_computation[llama-False]"),
    mutant("gemma-norm-offset-dropped", "pretrain/model/norm.py",
           "        if self.unit_offset:  # scaled in fp32, then cast, as Gemma computes it",
           "        if False:  # scaled in fp32, then cast, as Gemma computes it",
           "model.norm_unit_offset reads Gemma's stored w as the gain, not 1 + w",
           "tests/model/test_hf_families.py::test_import_gives_transformers_logits[gemma3]"),
    mutant("query-scale-dim-ignored", "pretrain/model/args.py",
           "            return self.query_scale_dim ** -0.5 if self.query_scale_dim else None",
           "            return None",
           "model.query_scale_dim (Gemma 3's query_pre_attn_scalar) leaves the attention scale at 1/sqrt(head_dim)",
           "tests/model/test_recipes.py::test_each_option_computes_its_definition[query_scale_dim]"),
    mutant("yarn-attention-factor-dropped", "pretrain/model/rope.py",
           '        gain = scaling["attention_factor"]', "        gain = 1.0",
           "YaRN's attention factor is not applied to cos and sin",
           "tests/model/test_hf.py::test_yarn_rope_scaling_matches_hf_past_the_original_context[qwen3]"),
    mutant("yarn-truncate-ignored", "pretrain/model/rope.py",
           '        if scaling["truncate"]:', "        if True:",
           "YaRN's ramp is always truncated (GPT-OSS's is not)",
           "tests/model/test_hf.py::test_yarn_rope_scaling_matches_hf_past_the_original_context[untruncated]"),
    mutant("local-layers-scaled", "pretrain/model/args.py",
           "        unscaled = self.rope_scaling_factor and not self.rope_local_scaling",
           "        unscaled = False",
           "a RoPE scaling reaches the local layers of OLMo 3 (which scales its global layers only)",
           "tests/model/test_hf_families.py::test_import_gives_transformers_logits[olmo3-yarn]"),
    mutant("clamped-swiglu-unclamped", "pretrain/model/feedforward.py",
           "    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)\n", "",
           "GPT-OSS's clamped SwiGLU is not clamped",
           "tests/model/test_hf_families.py::test_import_gives_transformers_logits[gpt_oss]"),
    mutant("gpt-oss-gate-and-up-swapped", "pretrain/hf/mapping.py",
           '_FUSED = {"gate_up_proj": (("w1", _gate), ("w3", _up))', '_FUSED = {"gate_up_proj": (("w1", _up), ("w3", _gate))',
           "GPT-OSS's interleaved gate_up_proj is read with gate and up swapped",
           "tests/model/test_hf_families.py::test_import_gives_transformers_logits[gpt_oss]"),
    mutant("expert-biases-not-split", "pretrain/checkpoint/reshard.py",
           '_EXPERTS = re.compile(r"\\.experts\\.[wb][123]$")', '_EXPERTS = re.compile(r"\\.experts\\.w[123]$")',
           "a resume into expert parallelism loads every expert's biases on each rank (GPT-OSS)",
           "tests/test_hf_families_training.py::test_gpt_oss_expert_biases_under_expert_parallelism_at_zero_2"),
    mutant("qwen3-moe-dense-blocks-ignored", "pretrain/hf/mapping.py",
           "                moe_dense_layers=len(dense))", "                moe_dense_layers=0)",
           "Qwen3-MoE's mlp_only_layers are read as MoE blocks",
           "tests/model/test_hf_families.py::test_import_gives_transformers_logits[qwen3_moe]"),
]


# ---------------------------------------------------------------------------------------- copies
def repo_files(repo: Path) -> list[str]:
    """Tracked files (their working-tree content) and untracked files git does not ignore."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f})


def make_copy(repo: Path, files: list[str], root: Path) -> Path:
    """root/<repo name>: a copy of `files`; root/shared links to the repository's ../shared (the
    tests read ../shared/data, relative to the repository)."""
    copy = root / repo.name
    for rel in files:
        src, dst = repo / rel, copy / rel
        if not src.is_symlink() and not src.is_file():  # deleted in the working tree (or a submodule)
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    if (repo.parent / "shared").exists():
        os.symlink(repo.parent / "shared", root / "shared")
    return copy


def problems(m: Mutant, text: str) -> list[str]:
    """Why `m` cannot be applied to `text` (its file's content): each old snippet must occur once,
    in order (a later edit sees the earlier ones applied)."""
    out = []
    for old, new in m.edits:
        n = text.count(old)
        if n != 1:
            out.append(f"{m.file}: {'no match' if n == 0 else f'{n} matches'} for {old.strip()[:70]!r}")
        else:
            text = text.replace(old, new)
    return out


def apply(m: Mutant, copy: Path) -> list[str]:
    path = copy / m.file
    if not path.is_file():
        return [f"{m.file} does not exist"]
    text = path.read_text()
    bad = problems(m, text)
    if not bad:
        for old, new in m.edits:
            text = text.replace(old, new)
        path.write_text(text)
    return bad


# ----------------------------------------------------------------------------------------- pytest
@dataclass
class Run:
    rc: int | None  # None: timed out
    seconds: float
    output: str

    @property
    def failed(self) -> list[str]:
        """The node ids in pytest's FAILED summary lines, and those (or test files, for a collection
        error) in its ERROR lines, marked "(error)"."""
        return [m.group(2) + (" (error)" if m.group(1) == "ERROR" else "")
                for m in re.finditer(r"^(FAILED|ERROR) (\S+?)(?: - .*)?$", self.output, re.M)]


def run_pytest(copy: Path, tests: list[str], k: str | None, timeout: float, stop_first: bool = True) -> Run:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
           f"--basetemp={copy.parent / 'pytest'}", *(["-x"] if stop_first else []), *(["-k", k] if k else []), *tests]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _end(proc)
        out, rc = (proc.communicate()[0] or ""), None
    except BaseException:  # Ctrl-C: leave nothing running
        _end(proc)
        raise
    return Run(rc, time.monotonic() - t0, out)


def _end(proc: subprocess.Popen) -> None:
    """End pytest and every process it started, by their ids: SIGTERM, then SIGKILL for those left
    after 15 s. (Some tests start their runs in sessions of their own: pytest's process group alone
    would leave them running.)"""
    import psutil

    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=15)


def in_copy(repo: Path, files: list[str], keep: bool, work):
    root = Path(tempfile.mkdtemp(prefix="mutation-"))
    try:
        return work(make_copy(repo, files, root))
    finally:
        if keep:
            print(f"  (kept {root})", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------ check
@dataclass
class Result:
    name: str
    file: str
    breaks: str
    tests: list[str]
    status: str  # killed, SURVIVED, STALE, TIMEOUT, ERROR
    killed_by: str
    seconds: float
    detail: str = ""


def run_mutant(m: Mutant, repo: Path, files: list[str], timeout: float, keep: bool, stop_first: bool) -> Result:
    def work(copy: Path) -> Result:
        bad = apply(m, copy)
        if bad:
            return Result(m.name, m.file, m.breaks, list(m.tests), "STALE", "", 0.0, "; ".join(bad))
        run = run_pytest(copy, list(m.tests), m.k, timeout, stop_first)
        if run.rc is None:
            status, detail = "TIMEOUT", f"tests still running after {timeout:.0f} s"
        elif run.rc == 0:
            status, detail = "SURVIVED", "the tests passed with the mutant applied"
        elif run.rc in (1, 2) or run.rc == 4 and run.failed:
            # 1: a test failed; 2, or 4 when node ids were named: a test file failed to import (the
            # mutant broke an import; pytest then reports those ids as not found)
            status, detail = "killed", ""
        else:  # 3 internal error, 4 usage error (a node id not found), 5 nothing collected
            status, detail = "ERROR", f"pytest exited {run.rc}: the test selection is broken, not the code"
        tail = "\n".join(run.output.strip().splitlines()[-(40 if status == "killed" else 15):])
        return Result(m.name, m.file, m.breaks, list(m.tests), status, ", ".join(run.failed) if status == "killed"
                      else "", run.seconds, f"{detail}\n{tail}".strip())

    return in_copy(repo, files, keep, work)


def baseline(mutants: list[Mutant], repo: Path, files: list[str], timeout: float, keep: bool) -> tuple[bool, float]:
    """Every selected test once, unmutated (all of them, no -x: every failure is shown)."""
    groups: dict[str | None, list[str]] = {}
    for m in mutants:
        groups.setdefault(m.k, [])
        groups[m.k] += [t for t in m.tests if t not in groups[m.k]]
    total, ok = 0.0, True
    for k, tests in groups.items():
        print(f"baseline: {len(tests)} tests{f' (-k {k})' if k else ''}, unmutated ...", flush=True)
        run = in_copy(repo, files, keep, lambda copy: run_pytest(copy, tests, k, timeout, stop_first=False))
        total += run.seconds
        last = run.output.strip().splitlines()[-1:] or [""]
        print(f"baseline: exit {run.rc} in {run.seconds:.0f} s: {last[0]}", flush=True)
        if run.rc != 0:
            ok = False
            print("\n".join(run.output.strip().splitlines()[-40:]), flush=True)
    return ok, total


def table(results: list[Result]) -> str:
    rows = ["| mutant | file | what it breaks | result | killed by | s |", "|---|---|---|---|---|---|"]
    for r in results:
        status = r.status if r.status == "killed" else f"**{r.status}**"
        killer = ", ".join(k.removeprefix("tests/") for k in r.killed_by.split(", ")) if r.status == "killed" \
            else (r.detail.splitlines()[0] if r.detail else "")
        rows.append(f"| {r.name} | {r.file} | {r.breaks} | {status} | {killer.replace('|', '/')} | {r.seconds:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--check", action="store_true", help="only check that every mutant still applies (STALE?)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    ap.add_argument("--every-test", action="store_true",
                    help="run all of a mutant's tests (no -x), to see every test that kills it")
    ap.add_argument("--show", action="store_true",
                    help="print the end of pytest's output for killed mutants too (was it killed for the reason meant?)")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per mutant (default 1500)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    ap.add_argument("--repo", type=Path, default=REPO, help=f"the repository (default {REPO})")
    args = ap.parse_args(argv)

    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {m.name for m in MUTANTS})
    if unknown:
        ap.error(f"unknown mutant(s) {', '.join(unknown)}; --list shows them")
    mutants = [m for m in MUTANTS if not names or m.name in names]
    repo = args.repo.resolve()

    if args.list:
        for m in mutants:
            print(f"{m.name}  ({m.file})\n    breaks: {m.breaks}\n    tests:  " + "\n            ".join(m.tests)
                  + (f"\n    -k {m.k}" if m.k else ""))
        return 0

    stale = {m.name: problems(m, (repo / m.file).read_text()) if (repo / m.file).is_file() else [f"{m.file} does not exist"]
             for m in mutants}
    stale = {k: v for k, v in stale.items() if v}
    for name, bad in stale.items():
        print(f"STALE {name}: {'; '.join(bad)}", flush=True)
    if args.check:
        print(f"{len(mutants) - len(stale)} of {len(mutants)} mutants apply")
        return 1 if stale else 0

    files = repo_files(repo)
    t0 = time.monotonic()
    base_s = 0.0
    if not args.no_baseline:
        ok, base_s = baseline([m for m in mutants if m.name not in stale], repo, files, max(args.timeout, 3600),
                              args.keep)
        if not ok:
            print("the baseline fails: the selected tests do not pass on the unmutated code; nothing concluded")
            return 2
    results = []
    for i, m in enumerate(mutants, 1):
        print(f"[{i}/{len(mutants)}] {m.name} ...", end=" ", flush=True)
        r = run_mutant(m, repo, files, args.timeout, args.keep, not args.every_test)
        results.append(r)
        print(f"{r.status} {r.killed_by} ({r.seconds:.0f} s)", flush=True)
        if r.detail and (r.status != "killed" or args.show):
            print("    " + r.detail.replace("\n", "\n    "), flush=True)
    total = time.monotonic() - t0
    print("\n" + table(results))
    bad = [r for r in results if r.status != "killed"]
    print(f"\n{len(results) - len(bad)} of {len(results)} mutants killed"
          + (f"; not killed: {', '.join(f'{r.name} ({r.status})' for r in bad)}" if bad else "")
          + f"; baseline {base_s:.0f} s, total {total:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "repo": str(repo), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([sys.argv[0], *sys.argv[1:]]),
            "cpus": os.cpu_count(), "baseline_s": base_s, "total_s": total,
            "results": [asdict(r) for r in results]}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
