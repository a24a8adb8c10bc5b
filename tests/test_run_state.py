"""Who owns a run dir and what a run may do to it, through the real command: ownership, the lock,
non-finite steps, verified readers, full disks, start-up signals, failed starts, metrics on resume."""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import (REPO, TINY, left_running, losses, pretrain, read_metrics, run_dir_files, run_train,
                     train_env)

pytestmark = pytest.mark.slow

O = ["data.seq_len=64", "train.micro_batch_size=4", "data.validation=[]", "train.eval_every=0",
     "logging.wandb=disabled", "logging.log_every=1", "distributed.zero_stage=3",
     "distributed.param_persistence_threshold=0"]


def _popen(overrides, **kw):
    cmd = [sys.executable, "-m", "pretrain", "train", str(TINY), "logging.progress=false", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def _one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pretrain: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_a_fresh_run_refuses_a_dir_holding_another_run(tmp_path):
    """Once: the fresh run trained, rotation deleted the old run's checkpoints, it died with
    FileNotFoundError, and resume=auto then continued the old run."""
    run = tmp_path / "x"
    run_train(O + [f"train.run_dir={run}", "train.max_steps=4", "checkpoint.every=2"])
    before = run_dir_files(run)
    again = O + [f"train.run_dir={run}", "train.max_steps=4", "checkpoint.every=2", "optimizer.lr=1e-3"]
    proc = run_train(again, check=False)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert f"run dir {run} holds run" in line and "checkpoint.resume=auto" in line and "train.overwrite" in line
    assert run_dir_files(run) == before  # nothing written, nothing deleted
    # An overwrite whose start then fails (its data is missing) puts the old run back: it was left
    # in replaced/ with an empty run dir.
    proc = run_train(again + ["train.overwrite=true", f"data.sources=[{{path: {tmp_path / 'missing.txt'}}}]"],
                     check=False)
    assert proc.returncode == 2 and "missing.txt" in _one_error_line(proc)
    assert run_dir_files(run) == before and not (run / "replaced").exists()
    # An explicit overwrite moves the old run aside (never deletes it) and starts a new run.
    old_id = json.loads((run / "run.json").read_text())["run_id"]
    run_train(again + ["train.overwrite=true"])
    moved = run / "replaced" / old_id
    assert run_dir_files(moved) == before
    new_id = json.loads((run / "run.json").read_text())["run_id"]
    assert new_id != old_id
    assert sorted(r["step"] for r in read_metrics(run) if "train/loss" in r) == list(range(1, 5))


def test_a_second_run_on_the_same_dir_refuses_naming_the_holder(tmp_path):
    with open(tmp_path.parent / f"{tmp_path.name}.first.log", "w+") as out:
        first = left_running(["train", str(TINY), "logging.progress=false", *O, f"train.run_dir={tmp_path}",
                              "train.max_steps=100000"], out)
        try:
            deadline = time.time() + 120
            while not (tmp_path / "metrics.jsonl").exists():
                assert first.poll() is None and time.time() < deadline, Path(out.name).read_text()[-3000:]
                time.sleep(0.1)
            second = run_train(O + [f"train.run_dir={tmp_path}", "checkpoint.resume=auto"], check=False)
            assert second.returncode == 2
            line = _one_error_line(second)
            assert f"is in use by pid {first.pid} on host {socket.gethostname()}" in line
            assert first.poll() is None  # the first run is unharmed
        finally:
            first.kill()
            first.wait()


@pytest.mark.parametrize("stage", [0, 3])
def test_an_overflow_with_a_finite_loss_stops_and_keeps_the_checkpoint(tmp_path, stage):
    """lr=30: step 1 is fine and saved; from step 2 the loss is finite but the gradients are not.
    Once: DeepSpeed skipped every step silently, the run exited 0, rotation deleted step 1. (ZeRO-3
    finds the overflow itself, stage 0 through our guard.)"""
    bad = O + [f"distributed.zero_stage={stage}", "optimizer.lr=30", "schedule.warmup_steps=0", "schedule.min_lr=0", "train.max_steps=6",
               "checkpoint.every=1", "checkpoint.keep_last=1"]
    proc = run_train(bad + [f"train.run_dir={tmp_path}/stop"], check=False)
    assert proc.returncode == 3
    assert re.search(r"gradient norm is (inf|nan) at step 2: stopped before the update", _one_error_line(proc))
    assert [p.name for p in (tmp_path / "stop" / "checkpoints").glob("step_*")] == ["step_00000001"]
    # skip: counted, and too many in a row stop the run (exit 3) with the last checkpoint intact.
    proc = run_train(bad + [f"train.run_dir={tmp_path}/skip", "train.on_nonfinite=skip",
                            "train.max_consecutive_skips=3"], check=False)
    assert proc.returncode == 3
    assert "3 dropped steps in a row (non-finite or spikes" in _one_error_line(proc)
    records = [r for r in read_metrics(tmp_path / "skip") if "train/loss" in r]
    assert [r["train/skipped_steps"] for r in records] == [0, 1, 2]  # step 4's record never logged: it stopped
    assert [p.name for p in (tmp_path / "skip" / "checkpoints").glob("step_*")] == ["step_00000003"]


@pytest.mark.parametrize("stage", [0, 3])
def test_skipped_steps_advance_the_schedule_and_log_the_rate_they_used(tmp_path, stage):
    """Adam with beta1 = beta2 = 0 and no weight decay moves each weight by lr x g / (|g| + eps), so
    by lr wherever its gradient is not tiny: the rate a step used, read off the weights of consecutive
    checkpoints (independently of the trainer and of Schedule), equals its logged train/lr. Step 3 is
    dropped (a NaN loss, on_nonfinite=skip): its weights do not move, and the schedule still
    advances past it (step 4 uses step 4's rate, not step 3's). At stage 0 our guard is what drops
    it; at ZeRO-3 DeepSpeed's own overflow check does it first."""
    from pretrain.checkpoint.weights import consolidated_state_dict

    over = O + ["optimizer.lr=1e-3", "optimizer.beta1=0", "optimizer.beta2=0", "optimizer.weight_decay=0",
                "optimizer.grad_clip=0", "schedule.warmup_steps=2", "schedule.decay_steps=4", "schedule.min_lr=0",
                "train.max_steps=5", "train.on_nonfinite=skip", "checkpoint.every=1", "checkpoint.keep_last=10",
                f"distributed.zero_stage={stage}"]
    run_train(over + [f"train.run_dir={tmp_path}"], env={"PRETRAIN_FAULT": "nan@step=3"})
    records = {r["step"]: r for r in read_metrics(tmp_path) if "train/loss" in r}
    assert [records[s]["train/skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    w = {s: consolidated_state_dict(tmp_path / "checkpoints" / f"step_{s:08d}")["layers.0.attention.wq.weight"]
         for s in range(1, 6)}
    for s in (2, 4, 5):
        used = (w[s] - w[s - 1]).abs().median().item()
        assert used == pytest.approx(records[s]["train/lr"], rel=1e-3), s  # (fp32 weights ~0.02 apart by ~1e-3)
    assert torch.equal(w[3], w[2])  # step 3 was dropped
    # warmup to 1e-3 over steps 1-2, then cosine to 0 over 4 steps from step 3
    expected = {1: 0.5e-3, 2: 1e-3, 3: 1e-3, 4: 1e-3 * (1 + math.cos(math.pi / 4)) / 2, 5: 0.5e-3}
    for s, lr in expected.items():
        assert records[s]["train/lr"] == pytest.approx(lr, rel=1e-9), s


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """A 1-step run of O: tests that change it change a copy."""
    run = tmp_path_factory.mktemp("one_step") / "run"
    run_train(O + [f"train.run_dir={run}", "train.max_steps=1"])
    return run


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_export_and_generate_verify_the_checkpoint_first(tmp_path, one_step, damage):
    shutil.copytree(one_step, tmp_path / "run")
    shard = tmp_path / "run" / "checkpoints" / "step_00000001" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[:len(data) // 2]
    shard.write_bytes(bytes(data))
    for args in (["export", f"{tmp_path}/run", f"{tmp_path}/hf"], ["generate", f"{tmp_path}/run"]):
        proc = pretrain(args, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = _one_error_line(proc)
        assert ("fails its checksum" if damage == "flip" else "truncated") in line
    assert not (tmp_path / "hf").exists()


def _can_mount_tmpfs() -> bool:
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount a tmpfs")
def test_a_full_disk_during_a_save(tmp_path):
    """A 36 MiB file system fits one 22 MB checkpoint, not two. Once: a 40-line traceback that never
    said the disk was full, and a partial folder left to keep it full."""
    if not _can_mount_tmpfs():
        pytest.skip("cannot mount a tmpfs here")
    small, out = tmp_path / "small", tmp_path / "out"
    small.mkdir()
    train = [sys.executable, "-m", "pretrain", "train", str(TINY), "logging.progress=false", *O,
             f"train.run_dir={small}/run", "train.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=2"]
    script = (f"mount -t tmpfs -o size=36m tmpfs {small} && "
              f"{' '.join(train)} > {tmp_path}/stdout 2> {tmp_path}/stderr; echo $? > {tmp_path}/rc; "
              f"cp -a {small}/run {out}")
    subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], cwd=REPO,
                   env=train_env(), check=True, timeout=300)
    rc = int((tmp_path / "rc").read_text())
    stderr = (tmp_path / "stderr").read_text()
    assert rc == 2, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("pretrain: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "no space left on the device of" in lines[0] and "step_00000002 is intact" in lines[0]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step_00000002"]  # no .partial_ left
    from pretrain.checkpoint.layout import open_checkpoint

    open_checkpoint(ckpts / "step_00000002")  # intact


def test_resume_from_an_older_checkpoint_does_not_repeat_steps(tmp_path):
    """Resumed from step 2 of a 4-step run: steps 3-4 are trained once more, logged once, and equal
    the first run's (step 4's loss needs step 3's update with the restored Adam moments). Before it,
    resumes from step 2 that a start check refuses, each after the run dir was read (a precision
    this machine cannot run, another data position, another model), end in one line and exit 2
    having changed nothing: step 4 stays, `latest` names it, run.json, config.yaml and metrics.jsonl
    are as they were. (Once: step 4 was set aside and `latest` rewritten before the precision was
    checked, so the next resume=auto silently trained steps 3-4 again.)"""
    run_train(O + [f"train.run_dir={tmp_path}", "train.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=5"])
    ref = losses(tmp_path)
    before = run_dir_files(tmp_path)
    older = [f"train.run_dir={tmp_path}", "train.max_steps=4", "checkpoint.every=2",
             f"checkpoint.resume={tmp_path}/checkpoints/step_00000002"]
    for change, named in (("train.precision=fp16", "train.precision=fp16 needs CUDA GPUs"),
                          ("train.precision=fp8", "train.precision=fp8"),
                          ("data.num_streams=2", "data.num_streams"),
                          ("model.n_heads=2", "another model shape")):
        proc = run_train(O + older + [change], check=False)
        assert proc.returncode == 2 and named in _one_error_line(proc), (change, proc.stderr[-2000:])
        assert run_dir_files(tmp_path) == before, change
    # ZeRO stage 0 refuses a resume at another precision once the engine is built: still before the start changes anything
    stage0 = tmp_path / "stage0"
    run_train(O + [f"train.run_dir={stage0}", "distributed.zero_stage=0", "train.precision=fp32", "train.max_steps=2",
                   "checkpoint.every=1"])
    kept = run_dir_files(stage0)
    proc = run_train(O + [f"train.run_dir={stage0}", "distributed.zero_stage=0", "train.precision=bf16",
                          "train.max_steps=2", f"checkpoint.resume={stage0}/checkpoints/step_00000001"], check=False)
    assert proc.returncode == 2 and "saved at ZeRO stage 0 in fp32" in _one_error_line(proc), proc.stderr[-2000:]
    assert run_dir_files(stage0) == kept
    shutil.rmtree(stage0)
    proc = run_train(O + older)
    assert "step_00000004 is newer than the checkpoint resumed from" in proc.stdout
    steps = [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert steps == [1, 2, 3, 4]  # once each
    assert losses(tmp_path) == ref  # and the same history
    [aside] = (tmp_path / "checkpoints" / "set_aside").iterdir()
    assert aside.name.startswith("step_00000004.after_step_00000002")


def test_failed_starts_leave_no_run_dir(tmp_path):
    proc = run_train(O + [f"train.run_dir={tmp_path}/new", f"data.sources=[{{path: {tmp_path}/missing.txt}}]"],
                     check=False)
    assert proc.returncode == 2 and "does not exist" in _one_error_line(proc)
    assert not (tmp_path / "new").exists()
    (tmp_path / "existing").mkdir()
    proc = run_train(O + [f"train.run_dir={tmp_path}/existing", "model.vocab_size=10"], check=False)
    assert proc.returncode == 2 and "smaller than the tokenizer" in _one_error_line(proc)
    assert [p.name for p in (tmp_path / "existing").iterdir()] in ([], [".lock"])
    # and the failed start did not claim the dir: a corrected run starts there
    run_train(O + [f"train.run_dir={tmp_path}/existing", "train.max_steps=1"])


def test_sigterm_during_start_up_says_so_and_exits_75(tmp_path):
    """Once: killed during imports with exit 143 and nothing printed."""
    proc = _popen(O + [f"train.run_dir={tmp_path}/run"], start_new_session=True)
    # Wait until the handler is installed (bit 15 of the caught-signals mask), then signal at once:
    # torch, DeepSpeed and the model are still being imported and built.
    deadline = time.time() + 60
    while True:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt")), 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            break
        assert time.time() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    assert "received SIGTERM during start-up: stopped before training" in out + err
    assert not (tmp_path / "run").exists()  # nothing trained, nothing left


def test_config_error_under_torchrun_prints_once(tmp_path):
    proc = run_train(["train.max_step=5", f"train.run_dir={tmp_path}"], nproc=2, check=False)
    assert proc.returncode != 0  # torchrun reports any failed worker as its own exit 1
    assert proc.stderr.count("pretrain: error: unknown key 'train.max_step'") == 1 + proc.stderr.count("traceback :")
    assert "exitcode  : 2" in proc.stderr  # each worker exited with 2; torchrun's report shows our line


def test_backend_from_the_yaml_is_used(tmp_path):
    """Once: only a command-line override was read; the YAML's backend was ignored."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl works")
    cfg = tmp_path / "nccl.yaml"
    cfg.write_text(f"extends: {TINY}\ndistributed:\n  backend: nccl\n")
    proc = run_train(O + [f"train.run_dir={tmp_path}/run"], config=cfg, check=False)
    assert proc.returncode == 2 and "distributed.backend=nccl needs CUDA" in _one_error_line(proc)


def test_checkpoints_and_run_json_name_the_code_that_wrote_them(one_step):
    from importlib.metadata import version

    meta = json.loads((one_step / "checkpoints" / "step_00000001" / "meta.json").read_text())
    run = json.loads((one_step / "run.json").read_text())
    # The tests run from a git checkout (CI: a clone): the commit is HEAD's, "-dirty" with changes.
    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, check=True).stdout.strip()  # noqa: E731
    dirty = git("status", "--porcelain", "--untracked-files=no")
    expected = git("rev-parse", "HEAD") + ("-dirty" if dirty else "")
    for record in (meta, run):
        assert record["pretrain_version"] == version("pretrain")
        assert record["git_commit"] == expected
    assert meta["run_id"] == run["run_id"] and meta["format"] == 2


def test_overwrite_together_with_resume_is_one_config_line(tmp_path, one_step):
    """A requeued job (checkpoint.resume) must never start over: with train.overwrite=true it is a
    config error before anything starts, and the run dir is left alone."""
    run = tmp_path / "run"
    shutil.copytree(one_step, run)
    before = run_dir_files(run)
    for resume in ("auto", str(run / "checkpoints" / "step_00000001")):
        proc = run_train(O + [f"train.run_dir={run}", "train.overwrite=true", f"checkpoint.resume={resume}"],
                         check=False)
        assert proc.returncode == 2
        assert _one_error_line(proc) == (f"pretrain: error: train.overwrite=true starts the run over, checkpoint.resume="
                                         f"{resume} continues it: set only one (a requeued job must never overwrite)")
        assert run_dir_files(run) == before and not (run / "replaced").exists()


FT = ["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "data.validation=[]",
      "train.eval_every=0", "logging.wandb=disabled", "logging.log_every=1", "train.max_steps=8",
      "schedule.warmup_steps=2", "distributed.zero_stage=0"]


def test_init_load_optimizer_and_keep_step_continue_the_run_they_start_from(tmp_path):
    """checkpoint.init_from with init_load_optimizer and init_keep_step takes the weights, the Adam
    state and the step (so the LR schedule) of step 4. A new run, with a fresh data position: told
    to skip the 4 global batches that step 4 had consumed (resilience.skip_batches), it draws the same
    data as the original run, and its steps 5-8 must then repeat the original's exactly. Without the
    optimizer state steps 6-8 differ (a fresh Adam); without the step, the rates and the data do."""
    base = tmp_path / "base"
    run_train(FT + [f"train.run_dir={base}", "checkpoint.every=4"])
    ft = tmp_path / "ft"
    proc = run_train(FT + [f"train.run_dir={ft}", f"checkpoint.init_from={base}/checkpoints/step_00000004",
                           "checkpoint.init_load_optimizer=true", "checkpoint.init_keep_step=true",
                           "resilience.skip_batches=[[5, 4]]"])
    assert f"fine-tuning from {base}/checkpoints/step_00000004 (step 4)" in proc.stdout
    want = {r["step"]: (r["train/loss"], r["train/lr"]) for r in read_metrics(base) if "train/loss" in r}
    got = {r["step"]: (r["train/loss"], r["train/lr"]) for r in read_metrics(ft) if "train/loss" in r}
    assert sorted(got) == [5, 6, 7, 8]
    assert got == {s: want[s] for s in got}
    assert json.loads((ft / "run.json").read_text())["run_id"] != json.loads((base / "run.json").read_text())["run_id"]
