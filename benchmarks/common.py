"""Helpers every benchmark script shares: prompt sets, machine facts, a Markdown table, JSON.

Prompt sets live in `../shared/data` next to the repository (see shared/data/SOURCES.md), or
wherever `--data_dir` points; they are inputs, not part of the package.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import platform
import sys
from typing import Any, Iterable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA_DIR = os.path.normpath(os.path.join(REPO, "..", "shared", "data"))

MT_BENCH = "mt_bench_question.jsonl"
HUMANEVAL = "HumanEval.jsonl.gz"
GSM8K = "gsm8k_test.jsonl"
MBPP = "mbpp.jsonl"
CLASSEVAL = "ClassEval_data.json"
DATASETS = ("mt_bench", "humaneval", "gsm8k", "mbpp", "classeval")
MBPP_TEST_IDS = range(11, 511)  # the standard MBPP test split: task ids 11..510


class DataError(Exception):
    """A prompt set that is missing or malformed; the message says which file and how to fix."""


def data_file(data_dir: str | None, name: str) -> str:
    """Path of one prompt-set file, with a clear error when the directory or file is absent."""
    data_dir = data_dir or DEFAULT_DATA_DIR
    if not os.path.isdir(data_dir):
        raise DataError(f"data directory {data_dir} not found: pass --data_dir=/path/to/data "
                        f"(the prompt sets described in shared/data/SOURCES.md)")
    path = os.path.join(data_dir, name)
    if not os.path.isfile(path):
        raise DataError(f"{path} not found: --data_dir must hold {name} "
                        f"(see shared/data/SOURCES.md)")
    return path


def _jsonl(path: str) -> Iterable[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: invalid JSON ({e.msg})") from None


def _take(path: str, field: str, n: int | None, pick=lambda v: v) -> list[str]:
    out = []
    for i, obj in enumerate(_jsonl(path), 1):
        if field not in obj:
            raise DataError(f"{path}:{i}: no {field!r} field")
        out.append(pick(obj[field]))
        if n is not None and len(out) >= n:
            break
    return out


def mt_bench_turn1(data_dir: str | None = None, n: int | None = None) -> list[str]:
    """The first turn of the first n MT-Bench questions (chat prompts)."""
    return _take(data_file(data_dir, MT_BENCH), "turns", n, lambda turns: turns[0])


def humaneval_prompts(data_dir: str | None = None, n: int | None = None) -> list[str]:
    """The `prompt` (signature + docstring, to be completed) of the first n HumanEval tasks."""
    return _take(data_file(data_dir, HUMANEVAL), "prompt", n)


def gsm8k_questions(data_dir: str | None = None, n: int | None = None) -> list[str]:
    """The `question` of the first n GSM8K test problems."""
    return _take(data_file(data_dir, GSM8K), "question", n)


def mbpp_prompts(data_dir: str | None = None, n: int | None = None) -> list[str]:
    """The first n MBPP test-split tasks (ids 11-510, file order): the task's `text`, then the
    asserts its code must pass (`test_list`), one per line."""
    path = data_file(data_dir, MBPP)
    out = []
    for i, obj in enumerate(_jsonl(path), 1):
        if not isinstance(obj, dict) or "text" not in obj or "test_list" not in obj:
            raise DataError(f"{path}:{i}: needs 'text' and 'test_list' fields")
        if obj.get("task_id") not in MBPP_TEST_IDS:
            continue
        tests = "\n".join(str(t) for t in obj["test_list"])
        out.append(f"{obj['text']}\nYour code should pass these tests:\n{tests}")
        if n is not None and len(out) >= n:
            break
    return out


def classeval_prompts(data_dir: str | None = None, n: int | None = None) -> list[str]:
    """The `skeleton` (imports, class and method signatures with docstrings, to be completed)
    of the first n ClassEval tasks."""
    path = data_file(data_dir, CLASSEVAL)
    try:
        with open(path, encoding="utf-8") as f:
            tasks = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON ({e.msg})") from None
    if not isinstance(tasks, list):
        raise DataError(f"{path}: expected a JSON list of tasks")
    out = []
    for i, task in enumerate(tasks[:n] if n is not None else tasks):
        if not isinstance(task, dict) or not isinstance(task.get("skeleton"), str):
            raise DataError(f"{path}: task {i} has no 'skeleton' string")
        out.append(task["skeleton"])
    return out


# data set -> (prompt texts loader, whether prompts go through the chat template)
PROMPT_SETS = {"mt_bench": (mt_bench_turn1, True), "humaneval": (humaneval_prompts, False),
               "gsm8k": (gsm8k_questions, True), "mbpp": (mbpp_prompts, True),
               "classeval": (classeval_prompts, False)}


def encoded_prompts(engine, name: str, n: int, data_dir: str | None = None) -> list[list[int]]:
    """The first n prompts of a data set as token ids: MT-Bench turn 1, GSM8K and MBPP with the
    chat template (when the engine chats), HumanEval and ClassEval raw (code to complete)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown data set {name!r}: {', '.join(PROMPT_SETS)}")
    load, chat = PROMPT_SETS[name]
    chat = chat and getattr(engine, "chat", True)
    return [engine.encode(t, chat=chat) for t in load(data_dir, n)]


def summarize_runs(runs: list[dict], baseline: str = "plain") -> list[dict]:
    """Per (data set, method) totals and ratios over its prompts, from per-prompt run records
    (dataset, method, tokens, steps, prefill_s, decode_s, exact, accepted_hist, W, N, G,
    step_tokens; looped methods also loops, advances, verified): S = tokens / steps (prefill
    counted), tokens/s over prefill + decode, ms per decode step, summed accepted-length
    histogram, and speed-up and step cost against the `baseline` method of the same data set."""
    groups = collections.defaultdict(list)
    for r in runs:
        groups[(r["dataset"], r["method"])].append(r)
    rows = []
    for (ds, method), rs in groups.items():
        tokens = sum(r["tokens"] for r in rs)
        steps = sum(r["steps"] for r in rs)
        secs = sum(r["prefill_s"] + r["decode_s"] for r in rs)
        decode_steps = sum(r["steps"] - 1 for r in rs)
        hists = [r["accepted_hist"] for r in rs if r.get("accepted_hist")]
        hist = [sum(x) for x in zip(*hists)] if hists and len(hists) == len(rs) else None
        row = {"dataset": ds, "method": method, "prompts": len(rs), "tokens": tokens,
               "steps": steps, "S": tokens / steps, "tokens_per_s": tokens / secs,
               "step_ms": 1e3 * sum(r["decode_s"] for r in rs) / max(decode_steps, 1),
               "exact": (sum(r["exact"] for r in rs) if rs[0]["exact"] is not None
                         else None), "accepted_hist": hist,
               "W": rs[0].get("W"), "N": rs[0].get("N"), "G": rs[0].get("G"),
               "step_tokens": rs[0].get("step_tokens", 1)}
        if "prompt_seeding" in rs[0]:
            row["prompt_seeding"] = rs[0]["prompt_seeding"]
        if all("loops" in r for r in rs):
            verified = max(sum(r["verified"] for r in rs), 1)
            row["loops_per_token"] = sum(r["loops"] for r in rs) / verified
            row["advances_per_token"] = sum(r["advances"] for r in rs) / verified
        rows.append(row)
    for row in rows:
        base = next((r for r in rows if r["dataset"] == row["dataset"]
                     and r["method"] == baseline), None)
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        row["step_cost"] = row["step_ms"] / base["step_ms"] if base else None  # baseline steps
    return rows


def parse_settings(text: str, seedings: Sequence[bool] = (False,)) -> list:
    """"15,5,15:7,5,7" -> LookaheadConfigs, each with every prompt-seeding choice given."""
    from lookahead_jax.lookahead.config import LookaheadConfig  # noqa: PLC0415
    out = []
    for part in text.split(":"):
        try:
            w, n, g = (int(x) for x in part.split(","))
        except ValueError:
            raise ValueError(f"bad setting {part!r}: expected W,N,G") from None
        out += [LookaheadConfig(W=w, N=n, G=g, prompt_seeding=s) for s in seedings]
    return out


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import jax  # noqa: PLC0415
    info = {"python": sys.version.split()[0], "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "jax": jax.__version__, "jax_backend": jax.default_backend(),
            "jax_devices": [str(d) for d in jax.devices()]}
    try:
        import transformers  # noqa: PLC0415
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import torch  # noqa: PLC0415
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; floats with 1 decimal (2 below 10), '|' in cells escaped."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            v = f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def short(text: str, width: int = 40) -> str:
    """One line of at most `width` characters, for table cells."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def write_json(path: str, obj: Any) -> str:
    """Writes `obj` as indented JSON, creating the parent directory; returns the path."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    return path
