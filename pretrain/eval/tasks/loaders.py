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
from pretrain.eval.tasks.formats import Instance


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
        if not isinstance(d["choices"], list):  # (a string would be taken as one choice per character)
            raise ValueError(f"choices {d['choices']!r} is not a list")
        return _mc(str(d["context"]), [str(c) for c in d["choices"]], _index(d["gold"]))
    if "contexts" in d:
        if not isinstance(d["contexts"], list):
            raise ValueError(f"contexts {d['contexts']!r} is not a list")
        contexts = [str(c) for c in d["contexts"]]
        return Instance("schema", contexts, [" " + str(d["continuation"])], _index(d["gold"]), contexts)
    if not str(d["continuation"]):
        raise ValueError("the continuation is empty: a cloze needs the words to score")
    return Instance("cloze", [str(d["context"])], [str(d["continuation"])], 0, [str(d["continuation"])])


def _index(gold) -> int:
    """A gold index as written: an integer (not true, not 1.7), or a string of one."""
    if isinstance(gold, bool) or not isinstance(gold, (int, str)):
        raise ValueError(f"gold {gold!r} is not the index of a choice (0, 1, ...)")
    return int(gold)


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


def load(spec: str, limit: int = 0, fewshot: int = 0) -> tuple[list[Instance], list[Instance], str]:
    """(instances scored, the pool few-shot examples come from, where the pool came from) of a task
    spec; `limit` > 0 keeps the first `limit` instances. The pool is the hub task's training split,
    else every row of the scored split or file, `limit` or not (an instance never demonstrates
    itself: scoring.fewshot_prefix); empty without `fewshot`."""
    name, _, path = spec.partition("=")
    shots = None
    if name in TASKS:
        hub, config, split, shot_split, convert = TASKS[name]
        rows = _rows(path, hub, config, split, name)
        where = f"{path or hub + ' (' + split + ')'}, the scored rows themselves"
        if fewshot and shot_split and not path:
            shots = _rows(path, hub, config, shot_split, name, fewshot=fewshot)
            where = f"{hub} ({shot_split})"
        fields = FIELDS[name]
    elif path or not name.endswith((".jsonl", ".json")):
        raise UserError(f"--tasks {spec}: unknown task {name!r}; tasks: {', '.join(TASKS)} (NAME or NAME=FILE), "
                        "or a .jsonl file of your own (docs/evaluation.md)")
    else:
        rows, convert, fields = _jsonl(name), _plain, ()
        where = f"{name}, the scored rows themselves"
    if not fewshot:
        instances = [_convert(convert, r, i, spec, fields) for i, r in enumerate(rows[:limit] if limit else rows)]
        if not instances:
            raise UserError(f"--tasks {spec}: no instances")
        return instances, [], ""
    every = [_convert(convert, r, i, spec, fields) for i, r in enumerate(rows)]
    instances = every[:limit] if limit else every
    if not instances:
        raise UserError(f"--tasks {spec}: no instances")
    # From the scored rows, the pool is the same Instance objects, so that each leaves itself out.
    pool = [_convert(convert, r, i, spec, fields) for i, r in enumerate(shots)] if shots is not None else every
    available = len(pool) - (shots is None)
    if available < fewshot:
        raise UserError(f"--fewshot {fewshot}: {spec} has {available} examples to draw from ({where}"
                        f"{', less the one scored' if shots is None else ''}): lower --fewshot")
    return instances, pool, f"{where}: {len(pool)} examples"


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
    # lm-eval gives an empty context the end-of-text token; one of only spaces would leave no
    # context token before the continuation (it mis-scores it silently).
    blank = [c for c in inst.contexts if c and not c.strip()]
    if blank:
        raise UserError(f"--tasks {spec}: row {i}: the context {blank[0]!r} is only whitespace: give text, or an "
                        "empty context (scored after the end-of-text token)")
    inst.id = str(row.get("id", row.get("ind", i)))
    return inst


def _jsonl(path: str) -> list[dict]:
    """A plain task file: one JSON object a line (rows may be of different formats)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"--tasks {path}: no such file")
    rows = []
    # split at "\n" only: str.splitlines() also splits at U+2028, U+0085, ... which JSON allows raw
    # inside strings (json.dumps(..., ensure_ascii=False) writes them so).
    for n, line in enumerate(p.read_text(errors="replace").split("\n"), 1):
        if line.strip():
            try:
                rows.append(dict(json.loads(line)))
            except (ValueError, TypeError):
                raise UserError(f"--tasks {path}:{n}: not a JSON object: one a line, {PLAIN_FIELDS}") from None
    return rows


def _rows(path: str, hub: str | None, config: str | None, split: str | None, name: str, fewshot: int = 0) -> list[dict]:
    """The task's rows: from local files (json, jsonl, parquet) when given, else from the hub
    (`fewshot`: the split is the few-shot pool's, named in the error)."""
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
        where = path or f"{hub} ({split})"
        # datasets wraps a bad line of a file in "An error occurred while generating the dataset";
        # the reason (e.g. "JSON parse error: ... in row 1") is its cause.
        reason = e.__cause__ if type(e).__name__ == "DatasetGenerationError" and e.__cause__ else e
        text = str(reason).splitlines()[0] if str(reason) else type(reason).__name__
        fix = f" (the few-shot pool of --fewshot {fewshot}; --fewshot 0 needs no pool)" if fewshot else ""
        raise UserError(f"--tasks {name}: could not read {where}{fix}: {text}")
    return [dict(r) for r in ds]
