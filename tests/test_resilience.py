"""Faults at scale, drilled with PRETRAIN_FAULT on 2 CPU ranks (docs/reliability.md): a hung rank
and a frozen one are named with their host and end the job within the timeout and a stated margin,
with every rank's stacks written; the resume after a hang or a crash equals a run without a fault,
bitwise; bad fault specs are one line."""

import json
import socket
import statistics
import subprocess
import sys
import time

import pytest

from helpers import REPO, TINY, free_port, losses, read_metrics, run_train, train_env
from pretrain.errors import ConfigError
from pretrain.faults import parse

BASE = ["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "logging.log_every=1",
        "logging.wandb=disabled", "schedule.warmup_steps=2", "distributed.zero_stage=3",
        "distributed.param_persistence_threshold=0", "train.max_steps=8", "checkpoint.every=2"]
TIMEOUT = 8  # resilience.hang_timeout_s in these tests
# After the timeout: the watchdog's wait for the other ranks' reports (at most 10 s) and torchrun's
# SIGTERM-then-SIGKILL of the ranks left (30 s), and the launcher's own exit.
MARGIN = 10 + 30 + 15


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The 2-rank run without a fault."""
    run = tmp_path_factory.mktemp("straight")
    run_train(BASE + [f"train.run_dir={run}"], nproc=2)
    return run


def _start(run_dir, fault="", extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "pretrain", "train", str(TINY), "logging.progress=false", *BASE,
           f"resilience.hang_timeout_s={TIMEOUT}", f"train.run_dir={run_dir}", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=train_env({"PRETRAIN_FAULT": fault} if fault else {}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _resume_equals(run_dir, straight):
    """Rerun with resume=auto: it finishes, and every step's loss (the later record of a step
    logged twice winning) equals the run without a fault."""
    run_train(BASE + ["checkpoint.resume=auto", f"train.run_dir={run_dir}"], nproc=2)
    got = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "train/loss" in r:
            got[r["step"]] = r["train/loss"]
    assert got == losses(straight)


def _hang_report(out: str) -> str:
    lines = [x for x in out.splitlines() if x.startswith("pretrain: hang at step")]
    assert len(lines) == 1, out[-4000:]
    return lines[0]


def _stacks(run_dir) -> dict[int, list[str]]:
    [incident] = (run_dir / "hangs").iterdir()
    return {int(p.stem.split("-")[1]): p.read_text().splitlines() for p in incident.glob("rank-*.txt")}


@pytest.mark.slow
def test_a_hung_rank_is_named_every_rank_exits_and_the_resume_is_exact(tmp_path, straight):
    start = time.time()
    proc = _start(tmp_path, "hang@rank=1,step=5")
    out, _ = proc.communicate(timeout=TIMEOUT + 120)
    assert time.time() - start < 60 + TIMEOUT + MARGIN  # (start-up and 4 steps take < 60 s)
    assert "exitcode  : 4" in out and proc.returncode != 0  # (torchrun itself exits 1)
    line = _hang_report(out)
    host = socket.gethostname()
    assert f"rank 1 (host {host}, in forward/backward of step 5) made no progress while the others waited" in line
    assert "rank 0" not in line
    stacks = _stacks(tmp_path)
    assert set(stacks) == {0, 1}
    head = json.loads(stacks[1][0])
    assert head["rank"] == 1 and head["step"] == 5 and not head["waiting"]
    assert json.loads(stacks[0][0])["waiting"]
    assert any("faults.py" in x and "at_forward" in x for x in stacks[1])  # where it hangs
    _resume_equals(tmp_path, straight)


@pytest.mark.slow
def test_a_frozen_rank_is_named_by_the_others(tmp_path):
    """Rank 1 stopped with SIGSTOP from outside (a node that stops answering): it writes nothing;
    rank 0's watchdog names it and ends the job."""
    import psutil

    proc = _start(tmp_path, extra=["train.max_steps=400"])
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    [rank1] = [c for c in psutil.Process(proc.pid).children() if c.environ().get("RANK") == "1"]  # (not its loaders)
    stopped = time.time()
    rank1.suspend()
    out, _ = proc.communicate(timeout=TIMEOUT + MARGIN + 30)
    assert time.time() - stopped < TIMEOUT + MARGIN
    assert not rank1.is_running() or rank1.status() == psutil.STATUS_ZOMBIE
    assert f"rank 1 (host {socket.gethostname()}) did not answer (frozen, or gone)" in _hang_report(out)
    assert set(_stacks(tmp_path)) == {0}


@pytest.mark.slow
def test_a_crashed_rank_resumes_exactly(tmp_path, straight):
    proc = _start(tmp_path, "crash@rank=0,step=5")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0 and "Signal 9 (SIGKILL)" in out, out[-3000:]
    assert list((tmp_path / "checkpoints").glob("step_*"))
    _resume_equals(tmp_path, straight)


@pytest.mark.slow
def test_a_slow_rank_is_found(tmp_path, straight):
    """Rank 1 sleeps 0.3 s in every step: its step times look like everyone's (the all-reduce waits
    for it), its busy time does not. The warning comes once, after 3 log steps in a row."""
    proc = run_train(BASE + [f"train.run_dir={tmp_path}"], nproc=2, env={"PRETRAIN_FAULT": "slow@rank=1,seconds=0.3"})
    records = [r for r in read_metrics(tmp_path) if "perf/slowest_rank" in r]
    assert len(records) == 8
    for r in records:
        assert r["perf/slowest_rank"] == 1 and r["perf/slowest_host"] == socket.gethostname()
        assert r["perf/straggler_ratio"] > 1.3  # (measured ~1.6-1.8 with steps of ~0.15 s of work)
        assert r["perf/straggler_ratio"] == r["perf/straggler_ratio_host"]
    # The compute view is not fooled: rank 0's wait for rank 1 (in ZeRO-3's gathers inside the
    # forward) is not compute. (Measured below 1.1 here; 1.25 leaves room for a loaded machine.)
    assert statistics.median(r["perf/straggler_ratio_compute"] for r in records) < 1.25
    warnings = [x for x in proc.stdout.splitlines() if "is a straggler" in x]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: rank 1 (host {socket.gethostname()})")
    assert "its host time" in warnings[0]
    assert {r["perf/slowest_rank"] for r in read_metrics(straight) if "perf/slowest_rank" in r} <= {0, 1}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 0])
def test_a_slow_device_is_found_by_its_compute_time(tmp_path, stage):
    """`slowcompute`: rank 1 sleeps 0.3 s inside its model's forward, as a slow GPU computes slowly.
    Its compute time (perf/straggler_ratio_compute: the forward of each module that holds
    parameters at ZeRO-3, after DeepSpeed's gather; the whole forward at stage 0) names it; without
    the compute clock's hooks the ratio would be 1 and this fails."""
    run_train(BASE + [f"train.run_dir={tmp_path}", f"distributed.zero_stage={stage}", "train.max_steps=6"],
              nproc=2, env={"PRETRAIN_FAULT": "slowcompute@rank=1,seconds=0.3"})
    records = [r for r in read_metrics(tmp_path) if "perf/slowest_rank" in r]
    assert len(records) == 6
    for r in records:
        assert r["perf/slowest_rank"] == 1
        assert r["perf/straggler_ratio_compute"] > 1.3  # (0.3 s against ~0.1 s of forward: ~1.5)


SPIKY = BASE + ["train.max_steps=16", "resilience.spike_warmup=8", "resilience.spike_window=16",
                "distributed.zero_stage=0", "checkpoint.every=10", "train.on_nonfinite=skip"]


@pytest.mark.slow
def test_a_spike_is_skipped_and_the_resume_decides_the_same(tmp_path):
    """spike@step=12 (loss and gradients x 1000) after 8 steps of history: the update is dropped and
    counted, exactly as a NaN at step 12 is dropped (every other step's loss is equal, bitwise). A
    resume from step 10 restores the history and drops it again (without it, nothing would be
    found: 0 steps of history)."""
    import shutil

    spiky, dropped = tmp_path / "spike", tmp_path / "nan"
    proc = run_train(SPIKY + [f"train.run_dir={spiky}"], env={"PRETRAIN_FAULT": "spike@step=12"})
    run_train(SPIKY + [f"train.run_dir={dropped}"], env={"PRETRAIN_FAULT": "nan@step=12"})
    assert "warning: step 12 is a spike (loss" in proc.stdout
    got, want = losses(spiky), losses(dropped)
    assert got[12] > 100 * got[11] and {s: v for s, v in got.items() if s != 12} == {
        s: v for s, v in want.items() if s != 12}
    assert [r["train/spike_skips"] for r in read_metrics(spiky) if "train/spike_skips" in r][-1] == 1
    resumed = tmp_path / "resumed"  # the run as it was at step 10, resumed with the fault armed again
    shutil.copytree(spiky, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000016")
    shutil.rmtree(resumed / "faults")
    (resumed / "checkpoints" / "latest").write_text("step_00000010")
    run_train(SPIKY + ["checkpoint.resume=auto", f"train.run_dir={resumed}"], env={"PRETRAIN_FAULT": "spike@step=12"})
    assert losses(resumed) == got  # (steps 11-16: the later records)


def _weights(run_dir, step):
    import torch

    [states] = (run_dir / "checkpoints" / f"step_{step:08d}").glob("mp_rank_00_model_states.pt")
    return torch.load(states, map_location="cpu", weights_only=False)["module"]


@pytest.mark.slow
def test_spikes_in_a_row_roll_back_and_skip_their_data(tmp_path):
    """Spikes at steps 12, 13 and 14 (3 within 5 steps): the run rolls back to its newest
    checkpoint before step 12 (step 6; step 12's, of the abandoned timeline, is moved aside) and skips
    4 batches before step 12. Its losses and final weights equal, bitwise, those of a run told from
    the start to skip those batches (resilience.skip_batches); a resume from a checkpoint after the
    rollback (its ledger says the skip is done) finishes the same."""
    import shutil

    import torch

    rollback = SPIKY + ["train.max_steps=24", "resilience.rollback_after=3", "resilience.rollback_window=5",
                        "resilience.rollback_skip_batches=4", "checkpoint.every=6"]
    rolled, told = tmp_path / "rolled", tmp_path / "told"
    proc = run_train(rollback + [f"train.run_dir={rolled}"],
                     env={"PRETRAIN_FAULT": "spike@step=12;spike@step=13;spike@step=14"})
    assert "warning: 3 spikes in steps 12-14: rolling back to step_00000006 and skipping 4 batches" in proc.stdout
    assert (rolled / "rolled_back" / "step_00000012.1" / "manifest.json").is_file()
    run_train(rollback + ["resilience.skip_batches=[[12,4]]", f"train.run_dir={told}"])
    assert losses(rolled) == losses(told)
    a, b = _weights(rolled, 24), _weights(told, 24)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["train/rollbacks"] for r in read_metrics(rolled) if "train/rollbacks" in r] == [1]
    resumed = tmp_path / "resumed"
    shutil.copytree(rolled, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000024")
    run_train(rollback + ["checkpoint.resume=auto", f"train.run_dir={resumed}"])
    c = _weights(resumed, 24)
    assert all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow
def test_spikes_past_the_last_rollback_stop_the_run(tmp_path):
    proc = run_train(SPIKY + ["resilience.rollback_after=3", "resilience.max_rollbacks=0", f"train.run_dir={tmp_path}"],
                     env={"PRETRAIN_FAULT": "spike@step=12;spike@step=13;spike@step=14"}, check=False)
    assert proc.returncode == 3
    assert "3 spikes in steps 12-14 after 0 rollbacks (resilience.max_rollbacks)" in proc.stderr


@pytest.mark.slow
def test_a_nan_fault_stops_the_run_at_its_step(tmp_path):
    proc = run_train(BASE + [f"train.run_dir={tmp_path}"], env={"PRETRAIN_FAULT": "nan@step=3"}, check=False)
    assert proc.returncode == 3 and "loss is nan at step 3" in proc.stderr


@pytest.mark.parametrize("spec,message", [
    ("hang", "hang needs step"),
    ("freeze@step=1", "unknown fault 'freeze'"),
    ("hang@step=x", "step='x' is not a number"),
    ("slow@rank=1", "slow needs seconds"),
    ("hang@rank=1,step=0", "step must be >= 1"),
    ("hang@step=2,when=3", "hang takes rank, step as key=value, not 'when=3'"),
    ("signal@step=3", "signal needs signum"),
    ("signal@step=3,signum=999", "signum=999 is not a signal number"),
])
def test_a_bad_fault_spec_is_one_line(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse(spec)


def test_fault_specs_parse():
    hang, slow, spike = parse("hang@rank=1,step=5; slow@rank=1,seconds=0.3;spike@step=12")
    assert (hang.kind, hang.rank, hang.step) == ("hang", 1, 5)
    assert slow.here(1, 1) and slow.here(1, 9) and not slow.here(0, 9) and slow.seconds == 0.3
    assert spike.here(0, 12) and spike.here(3, 12) and not spike.here(0, 11) and spike.factor == 1000
    sig, save = parse("signal@step=3,signum=15;savecrash@rank=0,step=6")
    assert (sig.kind, sig.step, sig.signum, sig.rank) == ("signal", 3, 15, -1)
    assert save.here(0, 6) and not save.here(1, 6) and not save.here(0, 7)


def test_a_bad_fault_is_refused_before_training(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pretrain", "train", str(TINY), f"train.run_dir={tmp_path / 'r'}"],
                          cwd=REPO, env=train_env({"PRETRAIN_FAULT": "hang@rank=1"}), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "pretrain: error: PRETRAIN_FAULT='hang@rank=1': hang needs step"]
    assert not (tmp_path / "r").exists()
