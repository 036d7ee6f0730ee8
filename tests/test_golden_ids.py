"""Behaviour pinned across refactors: the greedy token ids (and forward-pass counts) of every
method, on SmolLM2-135M-Instruct and on the shipped tiny looped models, for a few prompts.

`tests/data/golden_ids.json` was recorded before the library's redesign (issue #16) and must
stay equal after it: plain decoding, lookahead at two settings, prompt lookup, LoopSpec (with
and without the dual proposal) and LoopAhead with a small drafter (weights in
`tests/data/golden_drafter_<preset>.safetensors`, so its drafts do not depend on
initialisation order). Greedy outputs of lossless methods equal plain decoding's, so the ids
pin the model and the plain decoder; the step counts pin each method's own algorithm (its
pool, tree, schedule).

Re-record (only when a change is meant to alter them, and say why in the commit):
    python tests/test_golden_ids.py --record
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "data", "golden_ids.json")
DRAFTER = os.path.join(HERE, "data", "golden_drafter_{}.safetensors")  # per preset
NEW = 24
SMOL_PROMPTS = ["Write a haiku about JAX.", "What is 2 + 2? Answer briefly.",
                "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]
LOOPED_PROMPTS = ["What is a Python list?", "def count_words(text):"]
# method label -> (registry name, settings)
SMOL_METHODS = {
    "ar": ("ar", {}),
    "lookahead_5_3_5_seeded": ("lookahead", {"W": 5, "N": 3, "G": 5, "prompt_seeding": True}),
    "lookahead_7_5_7": ("lookahead", {"W": 7, "N": 5, "G": 7}),
    "prompt_lookup": ("prompt_lookup", {}),
}
LOOPED_METHODS = {
    "ar": ("ar", {}),
    "loopspec": ("loopspec", {}),
    "loopspec_d2": ("loopspec", {"d2": 2}),
    "loopahead_drafter": ("loopahead", {"drafter": True}),
}
DRAFTER_SHAPE = dict(hidden_size=64, num_layers=1, num_heads=2, K=3, draft_vocab=64)


def _method(engine, preset: str, name: str, settings: dict):
    """The registry's method; the LoopAhead row's small drafter has fixed weights from
    tests/data (a drafter file, loaded as `--lad=FILE` would be)."""
    from lookahead_jax.registry import build_method  # noqa: PLC0415
    settings = dict(settings)
    if settings.pop("drafter", False):
        settings["lad"] = DRAFTER.format(preset)
    return build_method(name, model_config=engine.config, **settings)


def _run_all(engine, preset, prompts_text, methods, chat: bool) -> dict:
    ids = [engine.encode(p, chat=chat) for p in prompts_text]
    out = {}
    for label, (name, settings) in methods.items():
        res = engine.generate_ids(ids, method=_method(engine, preset, name, settings),
                                  max_new_tokens=NEW)
        out[label] = {"tokens": res.tokens, "steps": res.stats.steps}
    return out


def _engines() -> dict:
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    from lookahead_jax.store.model_store import smollm2_gguf  # noqa: PLC0415
    from models.config import ConfigError  # noqa: PLC0415
    engines = {}
    try:
        smollm2_gguf(download=False)
        engines["smollm2_135m"] = Engine.from_preset("smollm2_135m")
    except ConfigError:
        pass
    engines["tiny_ouro"] = Engine.from_preset("tiny_ouro")
    engines["tiny_raven"] = Engine.from_preset("tiny_raven")
    return engines


def record() -> dict:
    got = {}
    for name, engine in _engines().items():
        if name == "smollm2_135m":
            got[name] = _run_all(engine, name, SMOL_PROMPTS, SMOL_METHODS, chat=True)
        else:
            got[name] = _run_all(engine, name, LOOPED_PROMPTS, LOOPED_METHODS, chat=True)
    return got


@pytest.fixture(scope="module")
def golden() -> dict:
    with open(GOLDEN) as f:
        return json.load(f)


@pytest.mark.parametrize("preset", ["tiny_ouro", "tiny_raven"])
def test_looped_methods_reproduce_recorded_ids(golden, preset):
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    got = _run_all(Engine.from_preset(preset), preset, LOOPED_PROMPTS, LOOPED_METHODS, chat=True)
    assert got == golden[preset]
    plain = golden[preset]["ar"]["tokens"]
    assert all(v["tokens"] == plain for v in got.values())  # lossless, greedy


def test_smollm2_methods_reproduce_recorded_ids(golden):
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    from lookahead_jax.store.model_store import smollm2_gguf  # noqa: PLC0415
    from models.config import ConfigError  # noqa: PLC0415
    try:
        smollm2_gguf(download=False)
    except ConfigError as e:
        pytest.skip(f"SmolLM2 not available: {e}")
    got = _run_all(Engine.from_preset("smollm2_135m"), "smollm2_135m", SMOL_PROMPTS, SMOL_METHODS, chat=True)
    assert got == golden["smollm2_135m"]
    plain = golden["smollm2_135m"]["ar"]["tokens"]
    assert all(v["tokens"] == plain for v in got.values())
    assert len({v["steps"] for v in got.values()}) > 1  # the methods really differ in steps


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_golden_ids.py --record")
    sys.path.insert(0, os.path.dirname(HERE))
    data = record()
    with open(GOLDEN, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {GOLDEN}: {', '.join(data)}", file=sys.stderr)
    _ = np  # numpy is imported for the drafter file's arrays
