"""Checkpoints: exact resume after a kill (1 and 2 ranks), resume at another world size, signals,
atomicity and rotation, mismatch errors, fine-tuning from shards."""

import json
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from helpers import REPO, TINY, losses, read_metrics, run_train, train_env
from pretrain.checkpoint.weights import consolidated_state_dict

pytestmark = pytest.mark.slow

BASE = ["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "logging.log_every=1",
        "logging.wandb=disabled", "schedule.warmup_steps=2", "schedule.decay_steps=8",
        "distributed.zero_stage=3", "distributed.param_persistence_threshold=0", "train.max_steps=8"]


def _start(overrides, fault):
    """One fresh process in a session of its own (a signal fault signals its whole process group)."""
    cmd = [sys.executable, "-m", "pretrain", "train", str(TINY), "logging.progress=false", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=train_env({"PRETRAIN_FAULT": fault}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


# straight[1]'s rotation (test_rotation_and_interrupted_saves): a save every 2 steps, the newest 2
# kept and every 4th, over the debris of a save killed midway.
ROTATION = ["checkpoint.every=2", "checkpoint.keep_last=2", "checkpoint.keep_every=4"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted 8-step runs at 1 and 2 ranks, the references: the 2-rank one saves steps 4 and
    8, the 1-rank one saves with ROTATION (steps 4, 6 and 8 kept)."""
    out = {}
    for nproc, saves in ((1, ROTATION), (2, ["checkpoint.every=4"])):
        run = tmp_path_factory.mktemp(f"straight{nproc}")
        if nproc == 1:
            (run / "checkpoints" / ".partial_step_00000010").mkdir(parents=True)
        run_train(BASE + saves + [f"train.run_dir={run}"], nproc=nproc)
        out[nproc] = run
    return out


@pytest.mark.parametrize("nproc", [1, 2])
def test_kill_and_resume_is_exact(tmp_path, straight, nproc):
    """Rank 0 is killed (SIGKILL, PRETRAIN_FAULT) in step 7, wherever the background saves are: the
    step-6 save had started, so the step-4 one was complete (saves never overlap). The resume from
    the newest complete checkpoint repeats the uninterrupted run, every step bitwise."""
    proc = run_train(BASE + ["checkpoint.every=2", f"train.run_dir={tmp_path}"], nproc=nproc,
                     env={"PRETRAIN_FAULT": "crash@rank=0,step=7"}, check=False)
    assert proc.returncode != 0
    assert (tmp_path / "checkpoints" / "step_00000004").is_dir()
    proc = run_train(BASE + ["checkpoint.every=2", "checkpoint.resume=auto", f"train.run_dir={tmp_path}"],
                     nproc=nproc)
    assert re.search(r"^resumed from .*step_0000000[46] at step [46]$", proc.stdout, re.M), proc.stdout
    assert losses(tmp_path) == losses(straight[nproc])  # bitwise, every step


def test_a_kill_during_a_background_save_keeps_the_previous_checkpoint(tmp_path, straight):
    """Saves are written in the background while training goes on: rank 0 is killed in the step-6
    save, its shards written and the checkpoint not yet complete (PRETRAIN_FAULT=savecrash). The
    step-4 checkpoint stays complete, the half-written save is never resumed from, and the resumed
    run repeats the uninterrupted one exactly."""
    from pretrain.checkpoint.layout import open_checkpoint

    proc = run_train(BASE + ["checkpoint.every=2", f"train.run_dir={tmp_path}"],
                     env={"PRETRAIN_FAULT": "savecrash@rank=0,step=6"}, check=False)
    assert proc.returncode == -signal.SIGKILL
    ckpts = tmp_path / "checkpoints"
    assert any((ckpts / ".partial_step_00000006").glob("*.pt"))  # killed with its shards on disk
    complete = sorted(p.name for p in ckpts.glob("step_*"))
    assert complete == ["step_00000002", "step_00000004"], complete
    for name in complete:
        open_checkpoint(ckpts / name)  # every visible checkpoint verifies
    proc = run_train(BASE + ["checkpoint.every=2", "checkpoint.resume=auto", f"train.run_dir={tmp_path}"])
    assert "at step 4" in proc.stdout
    assert losses(tmp_path) == losses(straight[1])


@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2)])
def test_resume_at_another_world_size(tmp_path, straight, saved, resumed):
    """The step-4 checkpoint of an N-rank run continues on M ranks: weights, optimizer, schedule and
    data position are restored (1 vs 2 ranks differ only by summation order, ~1e-6)."""
    shutil.copytree(straight[saved] / "checkpoints" / "step_00000004", tmp_path / "checkpoints" / "step_00000004")
    proc = run_train(BASE + ["checkpoint.resume=auto", f"train.run_dir={tmp_path}"], nproc=resumed)
    assert f"saved at world size {saved}" in proc.stdout
    got, want = losses(tmp_path), losses(straight[saved])
    assert sorted(got) == [5, 6, 7, 8]
    # Measured: losses within 7e-8 relative, final weights within 2e-5 of each tensor's largest
    # entry (Adam divides by small second moments, which magnifies summation-order differences).
    # A restore that got anything else wrong (a moment, weight decay on norms: ~1e-3 of the norm
    # weights after 4 steps, the rate) is far outside both.
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got[step], want[step])
    a = consolidated_state_dict(tmp_path / "checkpoints" / "step_00000008")
    b = consolidated_state_dict(straight[saved] / "checkpoints" / "step_00000008")
    for name in b:
        assert (a[name] - b[name]).abs().max() <= 1e-4 * b[name].abs().max(), name
    state = json.loads((tmp_path / "checkpoints" / "step_00000008" / "data_state.json").read_text())
    assert state["consumed"] == 8 * 8  # no sequence skipped or repeated


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_saves_then_exits_75_and_resume_continues(tmp_path, straight, sig):
    """SIGTERM (scancel) or SIGINT (Ctrl-C in a terminal) to the process group, data workers
    included: the step is finished and saved, exit 75, and the resume continues the run."""
    # The signal comes in step 3 (PRETRAIN_FAULT; SIGINT to the whole process group, SIGTERM too):
    # step 3 is finished and saved.
    signum = int(getattr(signal, sig))
    proc = _start(BASE + ["train.max_steps=400", "schedule.decay_steps=8", f"train.run_dir={tmp_path}"],
                  fault=f"signal@step=3,signum={signum}")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-2000:]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == ["step_00000003"]
    assert f"received {sig}: saved step 3" in out + err
    proc = run_train(BASE + ["checkpoint.resume=auto", f"train.run_dir={tmp_path}"])
    got, want = losses(tmp_path), losses(straight[1])
    assert got == want  # steps 1..step from the first run, the rest after the resume


def test_checkpoint_every_minutes_saves_on_the_clock(tmp_path, straight):
    """checkpoint.every_minutes=1e-4 (6 ms, less than a step): every step is saved, and the run is
    the same run (keep_every keeps them all to count)."""
    run_train(BASE + ["checkpoint.every_minutes=1e-4", "checkpoint.keep_every=1", f"train.run_dir={tmp_path}"])
    saved = sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == list(range(1, 9))
    assert losses(tmp_path) == losses(straight[1])


def test_rotation_and_interrupted_saves(tmp_path, straight):
    # straight[1] saved with ROTATION over the debris of a save killed midway (.partial_step_00000010,
    # never resumed from): the newest 2 and every 4th are kept, the debris is gone.
    ckpts = straight[1] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step_00000004", "step_00000006", "step_00000008"]
    assert (ckpts / "latest").read_text() == "step_00000008"
    manifest = json.loads((ckpts / "step_00000008" / "manifest.json").read_text())["files"]
    assert {"meta.json", "data_state.json", "trainer_state.json", "rng_state.json", "tokenizer.json"} <= set(manifest)
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    shutil.copytree(straight[1] / "checkpoints", ckpts)
    # A newer step folder that lost its manifest (a kill between write and rename cannot produce
    # it, but a user copy can): resume=auto says so, resumes from the newest intact one and moves
    # the broken one aside (kept, out of rotation and of later resumes).
    shutil.copytree(ckpts / "step_00000008", ckpts / "step_00000012")
    (ckpts / "step_00000012" / "manifest.json").unlink()
    proc = run_train(BASE + ["train.max_steps=9", "checkpoint.resume=auto", f"train.run_dir={run}"])
    assert "resumed from" in proc.stdout and "step_00000008" in proc.stdout
    assert "not resuming from step_00000012" in proc.stdout and "no manifest.json" in proc.stdout
    [aside] = (ckpts / "set_aside").iterdir()
    assert aside.name.startswith("step_00000012.corrupt")


@pytest.fixture(scope="module")
def saved_run(straight, tmp_path_factory):
    return straight[1]


def _corrupt_copy(src, dst, edit):
    shutil.copytree(src / "checkpoints" / "step_00000008", dst / "checkpoints" / "step_00000008")
    edit(dst / "checkpoints" / "step_00000008")
    return run_train(BASE + ["train.max_steps=9", "checkpoint.resume=auto", f"train.run_dir={dst}"], check=False)


def test_truncated_shard_is_refused(tmp_path, saved_run):
    def truncate(ckpt):
        shard = ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        shard.write_bytes(shard.read_bytes()[:1000])

    proc = _corrupt_copy(saved_run, tmp_path, truncate)
    assert proc.returncode == 2 and "truncated" in proc.stderr.splitlines()[-1], proc.stderr[-1500:]


def test_flipped_bytes_fail_the_checksum(tmp_path, saved_run):
    def flip(ckpt):
        shard = ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))

    proc = _corrupt_copy(saved_run, tmp_path, flip)
    assert proc.returncode == 2 and "fails its checksum" in proc.stderr, proc.stderr[-1500:]


def test_missing_shard_is_named(tmp_path, saved_run):
    proc = _corrupt_copy(saved_run, tmp_path,
                         lambda ckpt: (ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink())
    assert proc.returncode == 2 and "is missing zero_pp_rank_0_mp_rank_00_optim_states.pt" in proc.stderr


def test_other_model_shape_is_refused(tmp_path, saved_run):
    shutil.copytree(saved_run / "checkpoints", tmp_path / "checkpoints")
    proc = run_train(BASE + ["model.n_layers=3", "checkpoint.resume=auto", f"train.run_dir={tmp_path}"], check=False)
    assert proc.returncode == 2
    assert "another model shape (n_layers: checkpoint 4 vs config 3)" in proc.stderr


def test_other_rope_theta_is_refused_on_resume(tmp_path, saved_run):
    """A resume continues one run: a changed model.rope_theta (which no shape shows) is refused, as
    fine-tuning is the way to change it (it was accepted silently)."""
    shutil.copytree(saved_run / "checkpoints", tmp_path / "checkpoints")
    proc = run_train(BASE + ["model.rope_theta=20000", "checkpoint.resume=auto", f"train.run_dir={tmp_path}"],
                     check=False)
    assert proc.returncode == 2
    assert "another model (RoPE, norm, document masking, MoE routing, layer kinds) (rope_theta: checkpoint 10000.0 vs config 20000.0)" \
        in proc.stderr
    assert "fine-tune from it with checkpoint.init_from" in proc.stderr


@pytest.mark.parametrize("change, named", [
    (["model.document_mask=true"], "document_mask: checkpoint False vs config True"),
    (["model.document_mask=true", "model.document_positions=true"], "document_positions: checkpoint False vs config True"),
])
def test_a_resume_that_switches_document_masking_is_refused(tmp_path, saved_run, change, named):
    """Document masking changes which tokens attend to which, no weight: a resume that switches it
    (or its positions) on is refused in one line, as a rope_theta change is (it resumed with rc 0)."""
    shutil.copytree(saved_run / "checkpoints", tmp_path / "checkpoints")
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    proc = run_train(BASE + [*change, "checkpoint.resume=auto", f"train.run_dir={tmp_path}"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "another model (RoPE, norm, document masking, MoE routing, layer kinds)" in proc.stderr and named in proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_other_zero_stage_is_refused(tmp_path, saved_run):
    shutil.copytree(saved_run / "checkpoints", tmp_path / "checkpoints")
    proc = run_train(BASE + ["distributed.zero_stage=2", "checkpoint.resume=auto", f"train.run_dir={tmp_path}"],
                     check=False)
    assert proc.returncode == 2 and "saved with ZeRO stage 3, this run uses 2" in proc.stderr


def test_other_data_is_refused_unless_forced(tmp_path, saved_run):
    shutil.copytree(saved_run / "checkpoints", tmp_path / "checkpoints")
    other_data = tmp_path / "other.jsonl"  # (small: read in full by the forced resume)
    other_data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) + "\n"
                                  for i in range(200)))
    other = BASE + [f"data.sources=[{{path: {other_data}}}]", "checkpoint.resume=auto", f"train.run_dir={tmp_path}"]
    proc = run_train(other, check=False)
    assert proc.returncode == 2 and "saved with other data.sources" in proc.stderr.splitlines()[-1]
    assert "model:" not in proc.stdout  # refused before the model was built
    proc = run_train(other + ["train.max_steps=9", "data.force_resume=true"])
    assert "resumed from" in proc.stdout


def test_explicit_missing_checkpoint_path(tmp_path):
    proc = run_train(BASE + [f"checkpoint.resume={tmp_path}/nope", f"train.run_dir={tmp_path}"], check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_finetune_from_shards_of_another_world_size(tmp_path, straight):
    """init_from loads only the weights (here from a 2-rank checkpoint into 1 rank): the fine-tune
    starts at the pretrained loss, not at a fresh model's (straight[1]'s step 1: a fresh model on the
    same data), with a fresh step count and schedule."""
    ft = run_train(BASE + ["train.max_steps=2", f"checkpoint.init_from={straight[2]}/checkpoints",
                           "data.sources=[{path: builtin:python-docs}]", f"train.run_dir={tmp_path}/ft"],
                   config=REPO / "configs" / "finetune_tiny.yaml")
    assert "fine-tuning from" in ft.stdout
    got, scratch = losses(tmp_path / "ft"), losses(straight[1])
    assert sorted(got) == [1, 2]
    assert got[1] < scratch[1] - 0.5
    # A fresh schedule: step 1 uses the first warmup rate, lr / warmup_steps (not step 9's).
    [lr1] = [r["train/lr"] for r in read_metrics(tmp_path / "ft") if r.get("step") == 1 and "train/lr" in r]
    assert lr1 == pytest.approx(1e-3 / 2, rel=1e-12)  # finetune_tiny.yaml's lr; BASE's warmup_steps=2
    # The weights it starts from are exactly the newest checkpoint's (step 8, not step 4): a step at
    # lr 0 changes nothing, so its checkpoint holds them, consolidated from 2 ranks into 1.
    run_train(BASE + ["train.max_steps=1", "optimizer.lr=0", "schedule.min_lr=0", "checkpoint.every=1", f"checkpoint.init_from={straight[2]}/checkpoints",
                      "data.sources=[{path: builtin:python-docs}]", f"train.run_dir={tmp_path}/ft0"],
              config=REPO / "configs" / "finetune_tiny.yaml")
    loaded = consolidated_state_dict(tmp_path / "ft0" / "checkpoints" / "step_00000001")
    step8 = consolidated_state_dict(straight[2] / "checkpoints" / "step_00000008")
    assert loaded.keys() == step8.keys()
    for name in step8:
        assert torch.equal(loaded[name], step8[name]), name


def test_resume_continues_the_same_wandb_run(tmp_path):
    run_train(BASE + ["train.max_steps=2", "logging.wandb=offline", f"train.run_dir={tmp_path}"])
    run_train(BASE + ["train.max_steps=4", "logging.wandb=offline", "checkpoint.resume=auto",
                      f"train.run_dir={tmp_path}"])
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1  # one run id
    meta = json.loads((tmp_path / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert runs[0].name.endswith(meta["run_id"])
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] == meta["run_id"]


def test_stage0_checkpoint_resumes_at_another_world_size(tmp_path):
    """ZeRO stage 0 (configs/tiny.yaml's, for one device) saves the whole model and optimizer state
    in one file: another world size loads it directly, without a universal conversion."""
    base = [b for b in BASE if not b.startswith("distributed.")] + ["distributed.zero_stage=0"]
    two, one = tmp_path / "two", tmp_path / "one"
    run_train(base + ["checkpoint.every=4", f"train.run_dir={two}"], nproc=2)
    shutil.copytree(two / "checkpoints" / "step_00000004", one / "checkpoints" / "step_00000004")
    proc = run_train(base + ["checkpoint.resume=auto", f"train.run_dir={one}"])
    assert "saved at world size 2" in proc.stdout
    assert not (one / "checkpoints" / ".universal").exists()
    got, want = losses(one), losses(two)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:  # (summation order only, as in test_resume_at_another_world_size)
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got[step], want[step])
