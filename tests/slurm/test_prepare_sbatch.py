"""slurm/prepare.sbatch on the real 2-node test cluster: `pretrain data prepare` as a job array of
independent tasks, then a merge job that waits for them (afterok); the result is what one process
writes, and the printed config trains on it."""

import json

import pytest

from data_pipeline import prepare
from data_pipeline.config import DataConfig, SourceConfig
from data_pipeline.sources import resolve_source

pytestmark = pytest.mark.slow

SCRIPT = "slurm/prepare.sbatch"


def _corpus(root):
    root.mkdir()
    for f in range(5):
        (root / f"part-{f}.jsonl").write_text("".join(
            json.dumps({"text": f"document {f}.{i}: the value of a list is returned by the function {i}."}) + "\n"
            for i in range(300)))
    config = root.parent / "prep.yaml"
    config.write_text(f"data:\n  sources:\n    - path: {root}\n  seq_len: 32\n")
    return config


def test_prepare_runs_as_a_job_array_then_merges(slurm_cluster, tmp_path):
    config = _corpus(tmp_path / "corpus")
    out = tmp_path / "prepared"
    array = slurm_cluster.start(SCRIPT, [config, out], sbatch_opts=["--array=0-2", "--cpus-per-task=1"])
    merged = slurm_cluster.submit(SCRIPT, ["--merge", config, out],
                                  sbatch_opts=[f"--dependency=afterok:{array.job_id}", "--cpus-per-task=1"],
                                  timeout=240)
    tasks = array.wait(timeout=60)
    assert tasks.returncode == 0, tasks.output[-4000:]
    assert merged.returncode == 0, merged.output[-4000:]
    for i in range(3):  # each task took its own shards: k % 3 == i
        assert f"--task-index {i} --num-tasks 3" in tasks.output
    assert "tok/s" in tasks.output  # the progress bar, in the job log
    assert f"wrote {out}:" in merged.output and f"- path: {out}" in merged.output

    single = tmp_path / "single"
    prepare(DataConfig(sources=[SourceConfig(path=str(tmp_path / "corpus"))], seq_len=32), single,
            num_proc=1, progress=False)
    meta = [json.loads((d / "meta.json").read_text()) for d in (out, single)]
    assert meta[0]["shards"] == meta[1]["shards"] and meta[0]["tokens"] == meta[1]["tokens"] > 0
    for s in meta[0]["shards"]:
        assert (out / s["file"]).read_bytes() == (single / s["file"]).read_bytes()
    assert resolve_source(SourceConfig(path=str(out))).fingerprint == resolve_source(
        SourceConfig(path=str(single))).fingerprint


def test_a_non_contiguous_array_is_one_line(slurm_cluster, tmp_path):
    config = _corpus(tmp_path / "corpus")
    r = slurm_cluster.submit(SCRIPT, [config, tmp_path / "out"], sbatch_opts=["--array=0-2:2", "--cpus-per-task=1"],
                             timeout=60)
    assert r.returncode != 0 and "use a contiguous range" in r.output, r.output
