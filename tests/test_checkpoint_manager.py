"""CheckpointManager in one process with a stand-in for the DeepSpeed engine (it writes its shards
through the engine's checkpoint engine, as DeepSpeed does): durability order, failed saves, rotation
of this run's checkpoints only, the start point. Real DeepSpeed runs are in test_checkpoint.py."""

import dataclasses
import errno
import json
import os
from pathlib import Path

import pytest
import torch

from helpers import rewrite_file, rewrite_meta, run_dir_files
from pretrain.checkpoint.layout import open_checkpoint
from pretrain.checkpoint.manager import CheckpointManager
from pretrain.checkpoint.rundir import RunDir
from pretrain.config import CheckpointConfig
from pretrain.errors import CheckpointError, RunDirError
from pretrain.model.args import ModelArgs
from pretrain.parallel import distributed

ENV = distributed.Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
ARGS = ModelArgs(dim=8, n_layers=1, n_heads=2, vocab_size=16)


class _TorchEngine:
    def save(self, state, path):
        if state.get("full"):  # the device fills up halfway through this file
            with open(path, "wb") as f:
                f.write(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        torch.save(state, path)


class FakeEngine:
    """Hands one model and one optimizer shard to its checkpoint engine, as DeepSpeed's
    save_checkpoint does."""

    def __init__(self, fail_on_save: int = 0):
        self.checkpoint_engine = _TorchEngine()
        self.saves, self.fail_on_save = 0, fail_on_save

    def _copy_recovery_script(self, path):
        Path(path, "zero_to_fp32.py").write_text("# recovery script\n")

    def save_checkpoint(self, root, tag, save_latest):
        self.saves += 1
        folder = Path(root) / tag
        self.checkpoint_engine.save({"w": torch.ones(1000)}, str(folder / "mp_rank_00_model_states.pt"))
        optim = str(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        self.checkpoint_engine.save({"m": torch.zeros(1000), "full": self.saves == self.fail_on_save}, optim)
        self._copy_recovery_script(root)


class Counter:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def manager(run_dir, resume="none", engine=None, args=ARGS, **cfg):
    run = RunDir(run_dir, ENV)
    run.open()
    ckpt = CheckpointManager(run, CheckpointConfig(resume=resume, **cfg), ENV, model_args=args, zero_stage=3,
                             run_config={"distributed": {"zero_stage": 3}, "model": dataclasses.asdict(args)},
                             tokenizer_json="{}",
                             tokenizer_fingerprint="fp", overwrite=False, provenance={"pretrain_version": "t"})
    start = ckpt.plan_start()
    ckpt.begin(start)
    trainer = Counter()
    ckpt.track(engine=engine or FakeEngine(), trainer=trainer)
    return run, ckpt, start, trainer


def test_a_save_is_durable_before_it_is_visible(tmp_path, monkeypatch):
    """Every file (shards included) and the folder are fsynced before the rename to step_..., and
    the parent after it: after a power loss a step_ folder is complete."""
    events = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(self, target):
        events.append(("rename", str(self), str(target)))
        return real_rename(self, target)

    run, ckpt, _, trainer = manager(tmp_path / "run")
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    trainer.step = 5
    ckpt.save(5)
    ckpt.wait()
    final = run.checkpoints / "step_00000005"
    [(i, partial)] = [(i, e[1]) for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(final)]
    synced_before = {e[1] for e in events[:i] if e[0] == "fsync"}
    files = {str(Path(partial) / p.name) for p in final.iterdir()}
    assert files - {str(Path(partial) / "manifest.json")} <= synced_before
    assert partial in synced_before  # the folder's entries
    assert ("fsync", str(run.checkpoints)) in events[i + 1:]  # the rename itself
    open_checkpoint(final)  # and it verifies


def test_a_full_disk_removes_the_partial_save_and_keeps_the_previous(tmp_path):
    run, ckpt, _, trainer = manager(tmp_path / "run", engine=FakeEngine(fail_on_save=2))
    trainer.step = 1
    ckpt.save(1)
    first = ckpt.wait() and run.checkpoints / "step_00000001"
    trainer.step = 2
    ckpt.save(2)  # written in the background: the failure comes with the outcome
    with pytest.raises(CheckpointError) as e:
        ckpt.wait()
    message = str(e.value)
    assert "no space left" in message and str(run.checkpoints) in message
    assert "step_00000001 is intact" in message and "\n" not in message
    assert sorted(p.name for p in run.checkpoints.iterdir() if p.is_dir()) == ["step_00000001"]
    assert (run.checkpoints / "latest").read_text() == "step_00000001"
    open_checkpoint(first)


def test_rotation_keeps_checkpoints_of_other_runs(tmp_path):
    run, ckpt, _, trainer = manager(tmp_path / "run", keep_last=1)
    trainer.step = 1
    ckpt.save(1)
    ckpt.wait()
    alien = run.checkpoints / "step_00000001"
    meta = json.loads((alien / "meta.json").read_text())
    meta["run_id"] = "someone-else"
    (alien / "meta.json").write_text(json.dumps(meta))
    for step in (2, 3):
        trainer.step = step
        ckpt.save(step)
    ckpt.wait()
    assert sorted(p.name for p in run.checkpoints.iterdir() if p.is_dir()) == ["step_00000001", "step_00000003"]


def test_auto_resume_falls_back_past_a_corrupt_checkpoint_and_says_so(tmp_path, caplog):
    run, ckpt, _, trainer = manager(tmp_path / "run")
    for step in (1, 2):
        trainer.step = step
        ckpt.save(step)
    ckpt.wait()
    shard = run.checkpoints / "step_00000002" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    run.close(trained=True)
    caplog.set_level("INFO")
    run2, _, start, _ = manager(tmp_path / "run", resume="auto")
    assert start.kind == "resume" and start.step == 1
    assert "not resuming from step_00000002" in caplog.text and "truncated" in caplog.text
    assert not (run.checkpoints / "step_00000002").exists()
    assert [p.name.split(".")[:2] for p in (run.checkpoints / "set_aside").iterdir()] == [["step_00000002", "corrupt"]]
    assert (run.checkpoints / "latest").read_text() == "step_00000001"
    run2.close(trained=True)


def test_step_folders_but_none_intact_never_start_fresh(tmp_path):
    run, ckpt, _, trainer = manager(tmp_path / "run")
    trainer.step = 3
    ckpt.save(3)
    ckpt.wait()
    (run.checkpoints / "step_00000003" / "manifest.json").unlink()
    run.close(trained=True)
    with pytest.raises(CheckpointError, match="no usable checkpoint .*step_00000003 has no manifest.json"):
        manager(tmp_path / "run", resume="auto")
    assert (run.checkpoints / "step_00000003").is_dir()


def test_a_second_run_on_a_locked_dir_names_the_holder(tmp_path):
    run, *_ = manager(tmp_path / "run")
    other = RunDir(tmp_path / "run", ENV)
    # POSIX locks are per process: a second process is needed to see the first one's lock.
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            other.open()
            q.put("opened")
        except RunDirError as e:
            q.put(str(e))

    p = ctx.Process(target=child)
    p.start()
    p.join(30)
    message = q.get(timeout=5)
    assert f"is in use by pid {os.getpid()} on host {os.uname().nodename}" in message
    run.close(trained=True)


class SlowEngine(FakeEngine):
    """Saves a live tensor (the test changes it after save() returns) through a slow disk."""

    def __init__(self):
        super().__init__()
        self.weights = torch.zeros(1000)

    def save_checkpoint(self, root, tag, save_latest):
        folder = Path(root) / tag
        self.checkpoint_engine.save({"w": self.weights}, str(folder / "mp_rank_00_model_states.pt"))
        self.checkpoint_engine.save({"m": torch.zeros(10)}, str(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))


def test_a_save_blocks_only_for_the_copy_and_never_overlaps_the_previous(tmp_path):
    import threading

    engine = SlowEngine()
    run, ckpt, _, trainer = manager(tmp_path / "run", engine=engine, keep_last=5)
    events = []  # in the order they happened: no clock, so no race on a loaded machine
    release = threading.Event()  # the background writes wait for it

    def held_save(state, path):
        name = Path(path).parent.name
        events.append(("start", name))
        assert release.wait(60), "never released"
        torch.save(state, path)
        events.append(("end", name))

    engine.checkpoint_engine.inner.save = held_save
    trainer.step = 1
    ckpt.save(1)  # returns while its write is held: the loop is blocked for the copy only
    engine.weights += 1  # the next optimizer step changes the weights while the save is written
    assert not (run.checkpoints / "step_00000001").exists() and ("end", ".partial_step_00000001") not in events
    trainer.step = 2
    threading.Timer(0.2, release.set).start()
    ckpt.save(2)  # waits for step 1 to be complete first
    job = ckpt.wait()
    assert job.step == 2 and job.blocking_s < job.write_s
    # never overlapping: every write of step 1 ended before any of step 2 started
    first_end = max(i for i, e in enumerate(events) if e == ("end", ".partial_step_00000001"))
    second_start = min(i for i, e in enumerate(events) if e == ("start", ".partial_step_00000002"))
    assert second_start > first_end
    saved = torch.load(run.checkpoints / "step_00000001" / "mp_rank_00_model_states.pt")
    assert torch.equal(saved["w"], torch.zeros(1000))  # the state at save time, not what followed
    saved = torch.load(run.checkpoints / "step_00000002" / "mp_rank_00_model_states.pt")
    assert torch.equal(saved["w"], torch.ones(1000))


# ------------------------------------------------------------------ versions, fine-tuning, warnings
def _saved(run_dir, step=1, args=ARGS, **cfg):
    """A run dir holding one complete checkpoint of `step`; returns its folder (the run closed)."""
    run, ckpt, _, trainer = manager(run_dir, args=args, **cfg)
    trainer.step = step
    ckpt.save(step)
    ckpt.wait()
    run.close(trained=True)
    return run.checkpoints / f"step_{step:08d}"


def test_a_checkpoint_of_a_newer_format_is_refused_by_every_reader(tmp_path):
    ckpt = _saved(tmp_path / "run")
    rewrite_meta(ckpt, lambda m: m.update(format=3))
    want = f"checkpoint {ckpt} has format 3, newer than this pretrain reads (2): upgrade pretrain"
    with pytest.raises(CheckpointError) as e:
        manager(tmp_path / "run", resume="auto")
    assert str(e.value) == want
    with pytest.raises(CheckpointError) as e:
        manager(tmp_path / "ft", init_from=str(ckpt))
    assert str(e.value) == want
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(ckpt)  # export, generate, eval
    assert str(e.value) == want


def test_a_format_1_checkpoint_is_read_only_by_init_from(tmp_path):
    """Format 1 (written before run ids: no `format`, no `run_id`): its weights are read by init_from
    (and export), but it is never resumed and its optimizer state never loaded."""
    ckpt = _saved(tmp_path / "run", step=3)

    def to_format_1(meta):
        del meta["format"], meta["run_id"]

    rewrite_meta(ckpt, to_format_1)
    older = "has format 1, written by an older pretrain: this version cannot resume it, but checkpoint.init_from"
    for kw in ({"resume": "auto"}, {"resume": str(ckpt)}):
        with pytest.raises(CheckpointError, match=older):
            manager(tmp_path / "run", **kw)
    with pytest.raises(CheckpointError, match=older):
        manager(tmp_path / "ft1", init_from=str(ckpt), init_load_optimizer=True)
    run, _, start, _ = manager(tmp_path / "ft2", init_from=str(ckpt))
    assert (start.kind, start.path, start.step) == ("finetune", ckpt, 0)
    assert start.run_id == run.run_id and len(start.run_id) == 12  # a run of its own
    assert open_checkpoint(ckpt)[1].get("format", 1) == 1  # export's reader takes it


def test_init_keep_step_continues_the_step_count_of_the_checkpoint(tmp_path):
    ckpt = _saved(tmp_path / "run", step=7)
    for keep, want in ((True, 7), (False, 0)):
        run, ckpt_mgr, start, trainer = manager(tmp_path / f"ft-{keep}", init_from=str(ckpt), init_keep_step=keep)
        assert (start.kind, start.step) == ("finetune", want)
        trainer.step = 123
        ckpt_mgr.restore(start)
        assert trainer.step == want
        assert start.run_id != json.loads((ckpt / "meta.json").read_text())["run_id"]  # a new run


@pytest.mark.parametrize("flag", ["init_load_optimizer", "init_keep_step"])
def test_a_hugging_face_model_as_init_from_refuses_optimizer_and_step(tmp_path, flag):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))  # a model dir: config.json, no meta.json
    with pytest.raises(CheckpointError) as e:
        manager(tmp_path / "run", init_from=str(hf), **{flag: True})
    assert str(e.value) == (f"checkpoint.init_from={hf} is a Hugging Face model, which has weights only: unset "
                            "checkpoint.init_load_optimizer and checkpoint.init_keep_step")
    assert not (tmp_path / "run" / "run.json").exists()  # refused before the run dir was claimed


def test_a_save_warns_when_the_free_space_is_below_the_last_checkpoint(tmp_path, monkeypatch, caplog):
    import shutil
    from collections import namedtuple

    run, ckpt, _, trainer = manager(tmp_path / "run", keep_last=5)
    trainer.step = 1
    ckpt.save(1)
    ckpt.wait()
    size = sum(p.stat().st_size for p in (run.checkpoints / "step_00000001").iterdir() if p.name != "manifest.json")
    assert ckpt.last_size == size  # what the warning compares with
    usage = namedtuple("usage", "total used free")
    free = {"bytes": size}  # as much as the last checkpoint: no warning
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**40, 0, free["bytes"]))
    caplog.set_level("WARNING", logger="pretrain.checkpoint.manager")
    trainer.step = 2
    ckpt.save(2)
    ckpt.wait()
    assert "free on the device" not in caplog.text
    free["bytes"] = size - 1
    trainer.step = 3
    ckpt.save(3)
    ckpt.wait()
    [line] = [r.getMessage() for r in caplog.records if "free on the device" in r.getMessage()]
    assert line == (f"warning: {(size - 1) / 2**30:.2f} GiB free on the device of {run.checkpoints}, less than the "
                    f"last checkpoint's {size / 2**30:.2f} GiB: this save will probably fail")
    assert (run.checkpoints / "step_00000003" / "manifest.json").is_file()  # a warning: the save still ran


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_locks_warns_and_goes_on(tmp_path, monkeypatch, caplog, code):
    import fcntl

    def no_locks(fd, op, *args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    caplog.set_level("WARNING", logger="pretrain.checkpoint.rundir")
    run, ckpt, _, trainer = manager(tmp_path / "run")
    [line] = [r.getMessage() for r in caplog.records if "file locks" in r.getMessage()]
    assert line == (f"warning: {run.path} does not support file locks ({os.strerror(code)}): nothing stops a "
                    "second run from using this run dir at the same time")
    assert json.loads((run.path / ".lock").read_text())["pid"] == os.getpid()  # the holder is still named
    trainer.step = 1
    ckpt.save(1)
    ckpt.wait()
    open_checkpoint(run.checkpoints / "step_00000001")


def test_a_universal_conversion_is_kept_while_its_checkpoint_is(tmp_path):
    """A resume at another world size converts its checkpoint into checkpoints/.universal/ (cached:
    a rollback or a decay branch may go back to it); a save removes the conversions of checkpoints
    that are gone (rotated away), with the other leftovers, and keeps the others."""
    run, ckpt, _, trainer = manager(tmp_path / "run", keep_last=2)
    for step in (1, 2):
        trainer.step = step
        ckpt.save(step)
        ckpt.wait()
    for name in ("step_00000001", "step_00000002"):
        cache = run.checkpoints / ".universal" / name
        (cache / "zero" / "w").mkdir(parents=True)
        (cache / "zero" / "w" / "fp32.pt").write_bytes(b"x" * 100)
        (cache / "done").write_text("ok")
    trainer.step = 3
    ckpt.save(3)  # rotation removes step 1, and its conversion
    ckpt.wait()
    assert sorted(p.name for p in (run.checkpoints / ".universal").iterdir()) == ["step_00000002"]
    assert sorted(p.name for p in run.checkpoints.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "step_00000002", "step_00000003"]


# ------------------------------------------------------------------ an MoE's fields on a resume
MOE = dataclasses.replace(ARGS, n_layers=2, moe_experts=4, moe_hidden_dim=16, moe_dense_layers=1)


@pytest.mark.parametrize("change, named", [
    ({"moe_experts": 8}, "another model shape (moe_experts: checkpoint 4 vs config 8)"),
    ({"moe_hidden_dim": 32}, "another model shape (moe_expert_hidden_dim: checkpoint 16 vs config 32)"),
    ({"moe_shared_experts": 1}, "another model shape (moe_shared_experts: checkpoint 0 vs config 1)"),
    ({"moe_dense_layers": 0}, "another model shape (moe_dense_layers: checkpoint 1 vs config 0)"),
    ({"moe_experts": 0}, "another model shape (moe_experts: checkpoint 4 vs config 0)"),
    ({"moe_top_k": 1}, "(moe_top_k: checkpoint 2 vs config 1): use the model config it was saved with (to change "
                       "it, fine-tune from it with checkpoint.init_from)"),
    ({"moe_router": "sigmoid"}, "(moe_router: checkpoint softmax vs config sigmoid)"),
    ({"moe_norm_topk": False}, "(moe_norm_topk: checkpoint True vs config False)"),
])
def test_a_resume_with_another_moe_shape_or_routing_is_refused_in_one_line(tmp_path, change, named):
    """The fields that shape an MoE are refused as another shape (it was a load_state_dict size
    mismatch), the ones that route its tokens as a change of function, as rope_theta is (they were
    taken silently): one line, before anything loads, the run dir as it was."""
    _saved(tmp_path / "run", args=MOE)
    before = run_dir_files(tmp_path / "run")
    with pytest.raises(CheckpointError) as e:
        manager(tmp_path / "run", resume="auto", args=dataclasses.replace(MOE, **change))
    assert named in str(e.value) and "\n" not in str(e.value) and e.value.exit_code == 2, str(e.value)
    assert run_dir_files(tmp_path / "run") == before


def test_an_moes_balancing_may_change_on_a_resume_and_old_checkpoints_resume(tmp_path):
    """moe_aux_loss, moe_z_loss and moe_bias_rate weigh losses and step the bias, no weight and no
    forward: a resume may change them. A checkpoint written before meta.json recorded an MoE's fields
    is read as its config.yaml says: it resumes as before, and a change of them is still refused;
    a dense one's config.yaml had none of them (dense)."""
    ckpt = _saved(tmp_path / "run", args=MOE)
    run, _, start, _ = manager(tmp_path / "run", resume="auto",
                               args=dataclasses.replace(MOE, moe_aux_loss=0.1, moe_z_loss=1e-3, moe_bias_rate=1e-3))
    assert start.kind == "resume"
    run.close(trained=True)

    def unrecorded(meta):
        for key in ("model_shape", "model_function"):
            meta[key] = {k: v for k, v in meta[key].items() if not k.startswith("moe_")}

    rewrite_meta(ckpt, unrecorded)
    run, _, start, _ = manager(tmp_path / "run", resume="auto", args=MOE)
    assert start.kind == "resume"
    run.close(trained=True)
    for change, named in (({"moe_experts": 8}, "moe_experts: checkpoint 4 vs config 8"),
                          ({"moe_top_k": 1}, "moe_top_k: checkpoint 2 vs config 1")):
        with pytest.raises(CheckpointError, match=named):
            manager(tmp_path / "run", resume="auto", args=dataclasses.replace(MOE, **change))
    dense = _saved(tmp_path / "dense")
    rewrite_meta(dense, unrecorded)
    (dense / "config.yaml").write_text("distributed: {zero_stage: 3}\n")  # (before the model was in it)
    rewrite_file(dense, "config.yaml")
    run, _, start, _ = manager(tmp_path / "dense", resume="auto")
    assert start.kind == "resume"
    run.close(trained=True)
    with pytest.raises(CheckpointError, match="moe_experts: checkpoint 0 vs config 4"):
        manager(tmp_path / "dense", resume="auto", args=dataclasses.replace(ARGS, n_layers=1, moe_experts=4))


def test_a_checkpoint_that_predates_a_recipe_field_reads_it_as_llamas(tmp_path):
    """A checkpoint written before meta.json recorded the newest per-layer fields (norm_unit_offset,
    query_scale_dim: it has qk_norm and the others) is a block without them: it resumes as such, and a
    resume that asks for them is refused (it was taken silently: a missing function field is not
    compared)."""
    ckpt = _saved(tmp_path / "run")

    def unrecorded(meta):
        for key in ("model_shape", "model_function"):
            meta[key] = {k: v for k, v in meta[key].items() if k not in ("norm_unit_offset", "query_scale_dim")}

    rewrite_meta(ckpt, unrecorded)
    run, _, start, _ = manager(tmp_path / "run", resume="auto")
    assert start.kind == "resume"
    run.close(trained=True)
    for change, named in (({"norm_unit_offset": True}, "norm_unit_offset: checkpoint False vs config True"),
                          ({"query_scale_dim": 8}, "query_scale_dim: checkpoint 0 vs config 8")):
        with pytest.raises(CheckpointError, match=named):
            manager(tmp_path / "run", resume="auto", args=dataclasses.replace(ARGS, **change))
