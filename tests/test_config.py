"""The config system: precedence, extends, presets, and every user mistake's message."""

from pathlib import Path

import pytest

from pretrain.cli import main
from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.model.args import PRESETS

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(path)
    assert cfg.problems() == []
    assert cfg.model.preset in PRESETS or cfg.model.preset == ""


def test_precedence_defaults_file_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {preset: tiny, n_layers: 3}\ntrain: {max_steps: 7}\n")
    cfg = load_config(f, ["train.max_steps=9", "optimizer.lr=1e-2"])
    assert cfg.model.dim == PRESETS["tiny"]["dim"]  # preset
    assert cfg.model.n_layers == 3  # file beats preset
    assert cfg.train.max_steps == 9  # override beats file
    assert cfg.optimizer.lr == 0.01 and isinstance(cfg.optimizer.lr, float)
    assert cfg.train.micro_batch_size == 8  # default


def test_extends_merges_sections_deeply(tmp_path):
    (tmp_path / "base.yaml").write_text("train: {max_steps: 100, seed: 3}\ndata: {seq_len: 64}\n")
    (tmp_path / "ft.yaml").write_text("extends: base.yaml\ntrain: {max_steps: 10}\n")
    cfg = load_config(tmp_path / "ft.yaml")
    assert (cfg.train.max_steps, cfg.train.seed, cfg.data.seq_len) == (10, 3, 64)


def test_extends_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_unknown_key_names_closest_match():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.n_layer=3"])
    assert "unknown key 'model.n_layer'" in str(e.value) and "did you mean 'n_layers'" in str(e.value)


def test_unknown_section():
    with pytest.raises(ConfigError, match="did you mean 'optimizer'"):
        load_config(None, ["optimiser.lr=1"])


def test_wrong_type():
    with pytest.raises(ConfigError, match="train.max_steps must be int, got 'many'"):
        load_config(None, ["train.max_steps=many"])


def test_several_problems_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.dim=130", "model.n_heads=4", "model.n_kv_heads=3", "train.precision=fp4"])
    problems = e.value.problems
    assert any("not divisible by model.n_heads=4" in p for p in problems)
    assert any("n_kv_heads=3" in p for p in problems)
    assert any("train.precision='fp4'" in p for p in problems)


def test_traffic_settings_are_checked():
    with pytest.raises(ConfigError, match="distributed.max_reuse_distance=-1 must be >= 0"):
        load_config(None, ["distributed.max_reuse_distance=-1"])
    with pytest.raises(ConfigError, match="logging.comm_bytes must be bool"):
        load_config(None, ["logging.comm_bytes=3"])
    cfg = load_config(None, ["logging.comm_bytes=true", "distributed.max_reuse_distance=0"])
    assert cfg.logging.comm_bytes and cfg.distributed.max_reuse_distance == 0


def test_checkpoint_every_minutes_must_be_a_number_from_zero():
    with pytest.raises(ConfigError, match="checkpoint.every_minutes=-1.0 must be a number >= 0"):
        load_config(None, ["checkpoint.every_minutes=-1.0"])


@pytest.mark.parametrize("value", ["nan", "inf", "-.inf"])
@pytest.mark.parametrize("field", ["model.moe_bias_rate", "model.moe_aux_loss", "model.moe_z_loss", "model.rope_theta",
                                   "optimizer.weight_decay", "schedule.min_lr", "checkpoint.every_minutes",
                                   "distributed.timeout_s", "resilience.spike_sigma", "data.sources[0].weight",
                                   "scaling.budgets[0]"])
def test_nan_and_inf_are_refused_in_every_float_field_in_one_line(field, value, capsys):
    """Every float of every section (a source's, a list's items) is refused NaN and +-inf, in one line naming
    it, exit 2: NaN passes each range check (`x < 0` is false), and model.moe_bias_rate=nan trained with exit 0
    while the routing collapsed (no field is off or unlimited at inf: 0 says that)."""
    override = {"data.sources[0].weight": f"data.sources=[{{path: 'builtin:python-docs', weight: {value}}}]",
                "scaling.budgets[0]": f"scaling.budgets=[{value}]"}.get(field, f"{field}={value}")
    assert main(["config", "show", str(CONFIGS[0]), "model.moe_experts=4", override]) == 2
    shown = {"nan": "nan", "inf": "inf", "-.inf": "-inf"}[value]
    assert capsys.readouterr().err == f"pretrain: error: {field}={shown}: must be finite numbers\n"


def test_a_nan_coefficient_and_an_eot_id_outside_the_vocabulary_stop_a_run_before_it_starts(tmp_path):
    """`pretrain train`: model.moe_bias_rate=nan (it trained, exit 0) and model.eot_id past the 4096-token
    vocabulary the tokenizer gives (it trained as without the mask: no token matched) are one line, exit 2,
    before a step; so is an id below the -1 that means the tokenizer's."""
    from helpers import run_train

    for bad, named in ((["model.moe_experts=4", "model.moe_bias_rate=nan"], "model.moe_bias_rate=nan: must be finite"),
                       (["model.document_mask=true", "model.eot_id=999999"],
                        "model.eot_id=999999 is not a token of the vocabulary (model.vocab_size=4096)"),
                       (["model.document_mask=true", "model.eot_id=-2"], "model.eot_id=-2 is not a token")):
        run = tmp_path / bad[-1]
        proc = run_train([*bad, "logging.wandb=disabled", f"train.run_dir={run}"], check=False)
        errors = [x for x in proc.stderr.splitlines() if x.startswith("pretrain: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and named in errors[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and not (run / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match="model.eot_id=256 is not a token of the vocabulary .model.vocab_size=256."):
        load_config(None, ["model.vocab_size=256", "model.document_mask=true", "model.eot_id=256"])
    assert load_config(None, ["model.vocab_size=256", "model.document_mask=true", "model.eot_id=255"])


def test_odd_head_dim_for_rope():
    with pytest.raises(ConfigError, match="RoPE needs an even head_dim"):
        load_config(None, ["model.dim=36", "model.n_heads=4", "model.n_kv_heads=4"])


def test_batch_not_divisible_by_world_size():
    with pytest.raises(ConfigError, match="not divisible by micro_batch_size 4 x world size 3"):
        load_config(None, ["train.micro_batch_size=4", "train.global_batch_size=16"], world_size=3)
    cfg = load_config(None, ["train.micro_batch_size=4", "train.global_batch_size=16"], world_size=2)
    assert cfg.grad_accum(2) == 2


def test_streams_must_divide_by_world_size():
    with pytest.raises(ConfigError, match="data.num_streams=8 is not divisible by the world size 3"):
        load_config(None, ["train.micro_batch_size=1", "train.global_batch_size=3"], world_size=3)


def test_global_batch_in_tokens():
    cfg = load_config(None, ["data.seq_len=128", "train.global_batch_tokens=4096", "train.micro_batch_size=8"])
    assert cfg.global_batch(2) == 32 and cfg.grad_accum(2) == 2
    with pytest.raises(ConfigError, match="not a multiple of data.seq_len=128"):
        load_config(None, ["data.seq_len=128", "train.global_batch_tokens=1000"])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="did you mean '125m'"):
        load_config(None, ["model.preset=125M"])


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {max_steps: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cli_prints_resolved_config_and_exits_nonzero_on_error(capsys):
    assert main(["config", "show", str(CONFIGS[0]), "train.max_steps=11"]) == 0
    assert "max_steps: 11" in capsys.readouterr().out
    assert main(["config", "show", str(CONFIGS[0]), "train.max_step=11"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain: error: unknown key 'train.max_step'") and "Traceback" not in err


def test_relative_paths_follow_the_file_that_names_them(tmp_path, monkeypatch):
    """In a config file: relative to its directory (extends too); on the command line: relative to
    the working directory. Hub and builtin names are left alone."""
    project = tmp_path / "project"
    (project / "configs" / "base").mkdir(parents=True)
    (project / "data").mkdir()
    (project / "configs" / "base" / "b.yaml").write_text(
        "data: {tokenizer: ../../tok.json, validation: [{path: ../../data/val.jsonl}]}\n")
    (project / "configs" / "run.yaml").write_text(
        "extends: base/b.yaml\n"
        "data: {sources: [{path: ../data/*.jsonl}, {path: ../data}, {path: org/name}, {path: builtin:python-docs}]}\n"
        "train: {run_dir: ../runs/r}\ncheckpoint: {init_from: ../runs/old/checkpoints, resume: auto}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(project / "configs" / "run.yaml")
    assert cfg.data.tokenizer == str(project / "tok.json")  # from base/b.yaml, relative to it
    assert cfg.data.validation[0].path == str(project / "data" / "val.jsonl")
    assert [s.path for s in cfg.data.sources] == [str(project / "data" / "*.jsonl"), str(project / "data"),
                                                  "org/name", "builtin:python-docs"]
    assert cfg.train.run_dir == str(project / "runs" / "r") and cfg.checkpoint.resume == "auto"
    assert cfg.checkpoint.init_from == str(project / "runs" / "old" / "checkpoints")
    cfg = load_config(project / "configs" / "run.yaml", ["train.run_dir=mine", "data.tokenizer=hub:gpt2",
                                                         "data.sources=[{path: x.txt}]"])
    assert cfg.train.run_dir == str(elsewhere / "mine") and cfg.data.tokenizer == "hub:gpt2"
    assert cfg.data.sources[0].path == str(elsewhere / "x.txt")


@pytest.mark.slow
def test_a_run_starts_the_same_from_another_directory(tmp_path):
    """A config beside its own tokenizer and data, started from an unrelated directory: it trains,
    and the run dir lands where the config says."""
    import shutil

    from helpers import REPO, run_train

    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    shutil.copy(REPO / "data_pipeline" / "assets" / "python-docs-bpe.json", project / "tok.json")
    (project / "data" / "a.txt").write_text("".join(f"Paragraph {i}: a list of values.\n\n" for i in range(400)))
    (project / "run.yaml").write_text(f"extends: {REPO / 'configs' / 'tiny.yaml'}\n"
                                      "data: {tokenizer: tok.json, sources: [{path: data/a.txt}], validation: []}\n"
                                      "train: {run_dir: runs/r, max_steps: 2, eval_every: 0}\n")
    (tmp_path / "elsewhere").mkdir()
    run_train(["data.seq_len=32", "logging.wandb=disabled"], config=project / "run.yaml", cwd=tmp_path / "elsewhere")
    assert (project / "runs" / "r" / "checkpoints" / "step_00000002").is_dir()
    assert not (tmp_path / "elsewhere" / "runs").exists()


def test_paths_of_a_single_source_mapping_and_of_a_saved_config(tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text("data: {sources: {path: data/x.jsonl}}\n")
    monkeypatch.chdir(tmp_path.parent)
    assert load_config(tmp_path / "c.yaml").data.sources[0].path == str(tmp_path / "data" / "x.jsonl")
    # A run's saved config.yaml: its paths are kept as written (absolute now; older runs' relative
    # to the working directory), not re-read against the checkpoint directory.
    assert load_config(tmp_path / "c.yaml", saved=True).data.sources[0].path == "data/x.jsonl"
