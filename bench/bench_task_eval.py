"""What the in-loop task eval costs at the tiny scale: configs/tiny.yaml (200 steps, an eval every
50) with train.eval_tasks, against the same run's wall time.

The tasks are made from the built-in corpus, in the hub schemas: an ARC-style multiple choice of 4
(the question a sentence's start, the choices its real end and three other sentences' ends) and a
LAMBADA-style cloze (a sentence's last word), `--instances` each (the in-loop cap is 1000).

    python bench/bench_task_eval.py [--instances 200]
    python bench/bench_task_eval.py --write-tasks DIR [--instances 300]   # only write the two task files

(The second form writes the files the scaling ladder's worked example in docs/scaling.md uses.)
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def task_files(d: Path, n: int) -> list[str]:
    from data_pipeline import builtin

    rng = random.Random(0)
    sents = [s.strip() for doc in builtin.python_docs()
             for s in doc.replace("\n", " ").split(". ") if 8 <= len(s.split()) <= 30]
    rng.shuffle(sents)
    arc, lam = [], []
    for i in range(n):
        words = sents[i].split()
        cut = len(words) // 2
        ends = [" ".join(words[cut:])] + [" ".join(sents[n + 3 * i + j].split()[cut:]) or "." for j in range(3)]
        order = rng.sample(range(4), 4)
        arc.append({"id": str(i), "question": " ".join(words[:cut]), "answerKey": "ABCD"[order.index(0)],
                    "choices": {"text": [ends[k] for k in order], "label": list("ABCD")}})
        lam.append({"text": sents[i]})
    (d / "arc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arc))
    (d / "lambada.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lam))
    return [f"arc_easy={d / 'arc.jsonl'}", f"lambada_openai={d / 'lambada.jsonl'}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=200)
    ap.add_argument("--write-tasks", help="write the task files into this directory and stop")
    args = ap.parse_args()
    if args.write_tasks:
        Path(args.write_tasks).mkdir(parents=True, exist_ok=True)
        for spec in task_files(Path(args.write_tasks), args.instances):
            print(spec)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        specs = task_files(tmp, args.instances)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pretrain", "train", str(REPO / "configs" / "tiny.yaml"),
                        "logging.wandb=disabled", "logging.progress=false", f"train.run_dir={tmp / 'run'}",
                        f"train.eval_tasks=[{', '.join(specs)}]", f"train.eval_task_limit={args.instances}"],
                       check=True, capture_output=True, cwd=REPO)
        wall = time.perf_counter() - start
        records = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in records if "eval/tasks_s" in r]
        spent = sum(r["eval/tasks_s"] for r in evals)
        print(f"{len(evals)} task evals of {args.instances} ARC-style (4 choices) + {args.instances} LAMBADA-style "
              f"instances: {spent:.1f} s of a {wall:.1f} s run ({spent / wall:.1%}); "
              f"{spent / len(evals) / (2 * args.instances) * 1e3:.1f} ms per instance")
        last = evals[-1]
        print("final:", {k: round(v, 4) for k, v in last.items() if k.startswith("eval/")})


if __name__ == "__main__":
    main()
