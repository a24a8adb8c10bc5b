"""Task names and files -> instances: the hub datasets' own schemas, prompted exactly as
lm-evaluation-harness 0.4 prompts them (its task YAMLs), and a plain JSONL format for your own.

A task is given as NAME (the hub dataset, through `datasets`), NAME=PATH (the same schema from
local json/jsonl/parquet files, e.g. a copy of the hub's split) or PATH.jsonl (the plain format):

    {"context": "Q: 2+2?\\nA:", "choices": ["4", "5"], "gold": 0}          multiple choice
    {"contexts": ["The cup fell", "The bird fell"], "continuation": "off the table.", "gold": 0}   schema
    {"context": "The capital of France is", "continuation": " Paris"}        cloze

Choices and a schema's continuation are scored after a space (lm-eval's target delimiter); a cloze
continuation is scored as written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pretrain.errors import UserError
from pretrain.tasks.formats import Instance


def _hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(d: dict) -> Instance:
    ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
    return _mc(_hellaswag_text(d["activity_label"] + ": " + ctx), [_hellaswag_text(e) for e in d["endings"]],
               int(d["label"]))


def _arc(d: dict) -> Instance:
    return _mc(f"Question: {d['question']}\nAnswer:", list(d["choices"]["text"]),
               list(d["choices"]["label"]).index(d["answerKey"]))


def _piqa(d: dict) -> Instance:
    return _mc(f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], int(d["label"]))


def _sciq(d: dict) -> Instance:
    return _mc(f"{d['support'].lstrip()}\nQuestion: {d['question']}\nAnswer:",
               [d["distractor1"], d["distractor2"], d["distractor3"], d["correct_answer"]], 3)


def _winogrande(d: dict) -> Instance:
    blank = d["sentence"].index("_")
    contexts = [d["sentence"][:blank] + opt for opt in (d["option1"], d["option2"])]
    return Instance("schema", contexts, [" " + d["sentence"][blank + 1:].strip()], {"1": 0, "2": 1}[str(d["answer"])],
                    contexts)


def _lambada(d: dict) -> Instance:
    words = d["text"].split(" ")
    return Instance("cloze", [" ".join(words[:-1])], [" " + words[-1]], 0, [words[-1]])


def _mc(context: str, choices: list[str], gold: int) -> Instance:
    return Instance("multiple_choice", [context], [" " + c for c in choices], gold, list(choices))


def _plain(d: dict) -> Instance:
    d = {k: v for k, v in d.items() if v is not None}
    if "choices" in d:
        return _mc(str(d["context"]), [str(c) for c in d["choices"]], int(d["gold"]))
    if "contexts" in d:
        contexts = [str(c) for c in d["contexts"]]
        return Instance("schema", contexts, [" " + str(d["continuation"])], int(d["gold"]), contexts)
    return Instance("cloze", [str(d["context"])], [str(d["continuation"])], 0, [str(d["continuation"])])


# name -> (hub dataset, its config, the split scored, the split few-shot examples come from, row -> Instance)
TASKS = {
    "hellaswag": ("Rowan/hellaswag", None, "validation", "train", _hellaswag),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test", "train", _arc),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test", "train", _arc),
    "piqa": ("baber/piqa", None, "validation", "train", _piqa),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation", "train", _winogrande),
    "lambada_openai": ("EleutherAI/lambada_openai", "default", "test", None, _lambada),
    "sciq": ("allenai/sciq", None, "test", "train", _sciq),
}
# the fields each schema needs, named in the error for a file in another schema
FIELDS = {"hellaswag": ("ctx_a", "ctx_b", "activity_label", "endings", "label"),
          "arc_easy": ("question", "choices", "answerKey"), "arc_challenge": ("question", "choices", "answerKey"),
          "piqa": ("goal", "sol1", "sol2", "label"), "winogrande": ("sentence", "option1", "option2", "answer"),
          "lambada_openai": ("text",), "sciq": ("support", "question", "distractor1", "distractor2",
                                                "distractor3", "correct_answer")}
PLAIN_FIELDS = "context + choices + gold, contexts + continuation + gold, or context + continuation"


def task_name(spec: str) -> str:
    """The name a task's metrics go under: NAME, or a plain file's stem."""
    name = spec.split("=", 1)[0]
    return name if name in TASKS else Path(name).stem


def load(spec: str, limit: int = 0, fewshot: int = 0) -> tuple[list[Instance], list[Instance]]:
    """(instances scored, the pool few-shot examples come from) of a task spec; `limit` > 0 keeps the
    first `limit` instances. The pool is the hub task's training split, else the instances
    themselves (an instance never demonstrates itself); empty without `fewshot`."""
    name, _, path = spec.partition("=")
    if name in TASKS:
        hub, config, split, shot_split, convert = TASKS[name]
        rows = _rows(path, hub, config, split, name)
        shots = (_rows(path, hub, config, shot_split, name, quiet=True)
                 if fewshot and shot_split and not path else None)
        fields = FIELDS[name]
    elif path or not name.endswith((".jsonl", ".json")):
        raise UserError(f"--tasks {spec}: unknown task {name!r}; tasks: {', '.join(TASKS)} (NAME or NAME=FILE), "
                        "or a .jsonl file of your own (docs/evaluation.md)")
    else:
        rows, shots, convert, fields = _jsonl(name), None, _plain, ()
    instances = [_convert(convert, r, i, spec, fields) for i, r in enumerate(rows[:limit] if limit else rows)]
    if not instances:
        raise UserError(f"--tasks {spec}: no instances")
    if not fewshot:
        return instances, []
    pool = [_convert(convert, r, i, spec, fields) for i, r in enumerate(shots)] if shots else instances
    if len(pool) <= fewshot:
        raise UserError(f"--fewshot {fewshot}: {spec} has {len(pool)} examples to draw from")
    return instances, pool


def _convert(convert, row: dict, i: int, spec: str, fields) -> Instance:
    try:
        inst = convert(row)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        missing = [f for f in fields if f not in row]
        want = f"the fields {', '.join(fields)}" if fields else PLAIN_FIELDS
        raise UserError(f"--tasks {spec}: row {i} is not in the task's schema "
                        f"({'no ' + ', '.join(missing) if missing else type(e).__name__ + ': ' + str(e)}): "
                        f"it needs {want}") from None
    if not 0 <= inst.gold < len(inst.requests()):
        raise UserError(f"--tasks {spec}: row {i}: gold {inst.gold} is not the index of a choice")
    inst.id = str(row.get("id", row.get("ind", i)))
    return inst


def _jsonl(path: str) -> list[dict]:
    """A plain task file: one JSON object a line (rows may be of different formats)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"--tasks {path}: no such file")
    rows = []
    for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        if line.strip():
            try:
                rows.append(dict(json.loads(line)))
            except (ValueError, TypeError):
                raise UserError(f"--tasks {path}:{n}: not a JSON object: one a line, {PLAIN_FIELDS}") from None
    return rows


def _rows(path: str, hub: str | None, config: str | None, split: str | None, name: str, quiet=False) -> list[dict]:
    """The task's rows: from local files (json, jsonl, parquet) when given, else from the hub."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        if path:
            p = Path(path).expanduser()
            if not p.exists():
                raise UserError(f"--tasks {name}: {path} does not exist")
            kind = "parquet" if p.suffix == ".parquet" else "json"
            ds = datasets.load_dataset(kind, data_files=str(p), split="train")
        else:
            ds = datasets.load_dataset(hub, config, split=split)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; one line for each
        if quiet:
            return []
        where = path or f"{hub} ({split})"
        raise UserError(f"--tasks {name}: could not read {where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return [dict(r) for r in ds]
