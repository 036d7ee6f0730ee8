"""Helpers every benchmark script shares: prompt sets, machine facts, a Markdown table, JSON.

Prompt sets live in `../shared/data` next to the repository (see shared/data/SOURCES.md), or
wherever `--data_dir` points; they are inputs, not part of the package.
"""

from __future__ import annotations

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


def encoded_prompts(engine, name: str, n: int, data_dir: str | None = None) -> list[list[int]]:
    """The first n prompts of a data set as token ids: MT-Bench turn 1 and GSM8K with the chat
    template, HumanEval raw."""
    if name == "mt_bench":
        texts, chat = mt_bench_turn1(data_dir, n), True
    elif name == "humaneval":
        texts, chat = humaneval_prompts(data_dir, n), False
    elif name == "gsm8k":
        texts, chat = gsm8k_questions(data_dir, n), True
    else:
        raise ValueError(f"unknown data set {name!r}: mt_bench, humaneval or gsm8k")
    return [engine.encode(t, chat=chat) for t in texts]


def parse_settings(text: str, seedings: Sequence[bool] = (False,)) -> list:
    """"15,5,15:7,5,7" -> LookaheadConfigs, each with every prompt-seeding choice given."""
    from lookahead_jax.config import LookaheadConfig  # noqa: PLC0415
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
