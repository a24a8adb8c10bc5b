"""Export to Hugging Face format and sampling from checkpoints and exports."""

import json

import pytest
import torch

from helpers import rewrite_meta, run_train
from pretrain.cli import main
from pretrain.hf.export import export, load_for_inference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[0, 3], ids=["zero0", "zero3"])
def checkpoint(tmp_path_factory, request):
    """A 2-rank checkpoint: whole (ZeRO stage 0) or partitioned (ZeRO-3, DeepSpeed's consolidation)."""
    run = tmp_path_factory.mktemp("run")
    run_train(["data.seq_len=64", "train.micro_batch_size=4", "train.max_steps=3", "logging.wandb=disabled",
               "model.tie_embeddings=true", f"distributed.zero_stage={request.param}", f"train.run_dir={run}"],
              nproc=2)
    return run / "checkpoints"


def test_export_loads_in_transformers_offline_with_the_same_logits(tmp_path, checkpoint, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = export(str(checkpoint), str(tmp_path / "hf"))
    assert (out / "model.safetensors").is_file() and json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ours, tokenizer, eot = load_for_inference(str(checkpoint))
    hf_tok = AutoTokenizer.from_pretrained(out)
    text = "The return statement leaves the current function call."
    ids = tokenizer.encode(text).ids
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.eos_token_id == eot
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=2e-5, rtol=1e-5)
    # The export itself loads back into our model the same way.
    again, _, _ = load_for_inference(str(out))
    with torch.no_grad():
        torch.testing.assert_close(again(x), ours(x), atol=0, rtol=0)


def test_generate_is_seeded_and_the_same_from_checkpoint_and_export(tmp_path, checkpoint, capsys):
    out = export(str(checkpoint), str(tmp_path / "hf"))
    capsys.readouterr()
    args = ["--prompt", "The", "--max-new-tokens", "12", "--temperature", "0.9", "--top-k", "50", "--seed", "3"]
    assert main(["generate", str(checkpoint), *args]) == 0
    first = capsys.readouterr().out
    assert main(["generate", str(out), *args]) == 0
    assert capsys.readouterr().out == first and first.startswith("The")
    assert main(["generate", str(out), *args[:-1], "4"]) == 0
    assert capsys.readouterr().out != first  # another seed, another sample


def test_export_of_a_missing_or_incomplete_checkpoint(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "step_00000005").mkdir()
    assert main(["export", str(tmp_path / "step_00000005"), str(tmp_path / "out")]) == 2
    assert "incomplete" in capsys.readouterr().err


def test_a_format_1_checkpoint_exports_the_same_weights(tmp_path, checkpoint):
    """Format 1 (before run ids: no `format`, no `run_id` in meta.json) cannot be resumed, but export
    reads its weights: the export equals that of the same checkpoint in the current format."""
    import shutil

    from safetensors.torch import load_file

    from pretrain.checkpoint.layout import resolve_checkpoint

    src = resolve_checkpoint(checkpoint)
    old = tmp_path / "old" / src.name
    shutil.copytree(src, old)
    rewrite_meta(old, lambda m: (m.pop("format"), m.pop("run_id")))
    assert main(["export", str(old), str(tmp_path / "hf_old")]) == 0
    export(str(src), str(tmp_path / "hf_new"))
    got, want = load_file(tmp_path / "hf_old" / "model.safetensors"), load_file(tmp_path / "hf_new" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
