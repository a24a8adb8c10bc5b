"""Host syncs per optimizer step (bench/bench_host_syncs.py, the figure docs/performance.md quotes):
each one stalls a GPU run's CPU until the device has caught up, so the step makes one of its own."""

import json
import subprocess
import sys

import pytest

from helpers import REPO, train_env

pytestmark = pytest.mark.slow


def test_one_host_sync_of_ours_per_step_at_every_precision_and_stage(tmp_path):
    out = tmp_path / "syncs.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_host_syncs.py"), "--setups",
                           "fp32:0,bf16:0,bf16:2,bf16:3", "--steps", "3", "--accum", "4", "--json", str(out)],
                          cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["setup"]: r for r in json.loads(out.read_text())}
    for setup, r in rows.items():
        assert r["steps"] == 2 and r["ours"] == 1, (setup, r["places"]["ours"])
        assert r["other"] == 0, (setup, r["places"]["other"])
    # bf16 on one device: DeepSpeed's bf16 optimizer (its norm check and clip), not its stage-0 path
    # that checked each of the 39 parameters for overflow on the host (44 syncs a step).
    assert rows["bf16:0"]["deepspeed"] <= 2, rows["bf16:0"]["places"]["deepspeed"]
    assert rows["bf16:3"]["deepspeed"] <= 1, rows["bf16:3"]["places"]["deepspeed"]
