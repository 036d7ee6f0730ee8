"""Prompts for the command line: token ids, text files and JSONL benchmark files.

    read_prompt_file("prompts.txt")              # one prompt per line (blank lines skipped)
    read_prompt_file("question.jsonl", limit=5)  # "prompt" (HumanEval), else the first of
                                                 # "turns" (MT-Bench), else "question" (GSM8K)
    parse_prompt_ids("1, 2,3")                   # [1, 2, 3]

Every malformed input raises `ConfigError` naming the file (and line) and what is wrong.
"""

from __future__ import annotations

import json

from models.config import ConfigError

JSONL_FIELDS = ("prompt", "turns", "question")


def parse_prompt_ids(text: str) -> list[int]:
    """"1, 2,3" -> [1, 2, 3]; raises ConfigError on anything else."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ConfigError("empty prompt: --prompt_ids has no token ids")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--prompt_ids must be comma-separated integers, got {text!r}") from None


def _jsonl_prompt(obj, where: str) -> str:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    for field in JSONL_FIELDS:
        value = obj.get(field)
        if field == "turns" and isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, str):
            return value
    raise ConfigError(f"{where}: no string field {' / '.join(JSONL_FIELDS)}")


def read_prompt_file(path: str, limit: int = 0) -> list[str]:
    """Prompts from a text file (one per line) or a .jsonl file (see the module docstring)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"--prompt_file {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--prompt_file {path}: is a directory") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompt_file {path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise ConfigError(f"--prompt_file {path}: cannot read: {e.strerror or e}") from None
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{i}: invalid JSON ({e.msg})") from None
            prompts.append(_jsonl_prompt(obj, f"{path}:{i}"))
        else:
            prompts.append(line)
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise ConfigError(f"--prompt_file {path}: no prompts in it")
    return prompts
