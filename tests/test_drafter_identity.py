"""A drafter file records the looped model it was trained on (`base_digest`, a `params_digest`
of the model's parameters): `train_lad` writes it, `train_lad.stamp` adds it to older files
after checking the training record, every shipped drafter carries its shipped model's, and an
engine warns (`DrafterModelWarning`) when a method's drafter records another model, while its
output stays plain greedy's. The digest tolerates loading in bfloat16 or float32 and sees a
change of one bfloat16 step."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from lookahead_jax.looped.drafter import (BASE_META, DRAFTER_FILE, DrafterModelWarning,
                                          LadDrafter, _rewrite, params_digest, set_base_digest)
from models.build import build_looped
from models.config import ConfigError
from test_looped import CONFIGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(d for d in os.listdir(os.path.join(REPO, "checkpoints"))
                 if d.endswith("_lad"))
TINY = ("tiny_ouro_lad", "tiny_raven_lad", "tiny_raven_r4_lad")


def _scaled_leaf(model, factor: float):
    """A copy of `model` whose first parameter (in path order) with a nonzero first value has
    that value times factor."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    order = sorted(range(len(leaves)), key=lambda i: jax.tree_util.keystr(leaves[i][0]))
    i = next(i for i in order if float(leaves[i][1].ravel()[0]) != 0)
    values = [x for _, x in leaves]
    values[i] = values[i].at[(0,) * values[i].ndim].multiply(factor)
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values))


def test_params_digest_tolerates_the_load_dtype_and_sees_one_bfloat16_step():
    model = build_looped(CONFIGS["ouro"], rngs=nnx.Rngs(3))
    digest = params_digest(model)
    assert len(digest) == 16 and int(digest, 16) >= 0
    graphdef, state = nnx.split(model)
    as_bf16 = nnx.merge(graphdef, jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, state))
    assert params_digest(as_bf16) == digest  # the same checkpoint loaded in bfloat16
    assert params_digest(as_bf16, jnp.float32) != params_digest(model, jnp.float32)
    # below bfloat16's resolution the bfloat16 digest is unchanged, the float32 one is not
    tiny = _scaled_leaf(model, 1 + 2.0 ** -12)
    assert params_digest(tiny) == digest
    assert params_digest(tiny, jnp.float32) != params_digest(model, jnp.float32)
    # one part in 64 (several bfloat16 steps) changes it, as does another seed
    assert params_digest(_scaled_leaf(model, 1 + 2.0 ** -6)) != digest
    assert params_digest(build_looped(CONFIGS["ouro"], rngs=nnx.Rngs(4))) != digest


def _tiny_ouro_engine():
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    return Engine.from_preset("tiny_ouro", ckpt=os.path.join(REPO, "checkpoints", "tiny_ouro"))


def _copy_drafter(tmp_path, name="tiny_ouro_lad") -> str:
    src = os.path.join(REPO, "checkpoints", name)
    if not os.path.isdir(src):
        pytest.skip(f"no shipped drafter at {src}")
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return str(dst)


def test_engine_warns_for_a_drafter_of_another_model_and_stays_exact(tmp_path):
    lad = _copy_drafter(tmp_path)
    engine = _tiny_ouro_engine()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the drafter's own model: no warning
        right = engine.build_method("loopahead", lad=lad)
    assert right.drafter.base_digest == params_digest(
        nnx.merge(engine.graphdef, engine.params))
    set_base_digest(os.path.join(lad, DRAFTER_FILE), "0123456789abcdef")
    with pytest.warns(DrafterModelWarning, match="0123456789abcdef.*stays exact"):
        wrong = engine.build_method("loopahead", lad=lad)
    # a method instance given to generate is checked the same way
    with pytest.warns(DrafterModelWarning):
        engine.resolve_method(wrong, None)
    prompt = [[5, 17, 3, 9]]
    plain = engine.generate_ids(prompt, method="ar", max_new_tokens=12)
    with pytest.warns(DrafterModelWarning):
        got = engine.generate_ids(prompt, method=wrong, max_new_tokens=12)
    assert got.tokens == plain.tokens
    # a file written before drafters recorded their model: nothing to check, no warning
    _rewrite(os.path.join(lad, DRAFTER_FILE), lambda tensors, meta: meta.pop(BASE_META))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old = engine.build_method("loopahead", lad=lad)
    assert old.drafter.base_digest is None


def test_a_malformed_base_digest_is_refused(tmp_path):
    lad = _copy_drafter(tmp_path)
    path = os.path.join(lad, DRAFTER_FILE)
    with pytest.raises(ValueError, match="16 lowercase hex digits"):
        set_base_digest(path, "not-a-digest")
    _rewrite(path, lambda tensors, meta: meta.__setitem__(BASE_META, "xyz"))
    with pytest.raises(ConfigError, match="metadata base_digest is 'xyz'"):
        LadDrafter.load(lad)


def test_stamp_checks_the_training_record_and_changes_metadata_only(tmp_path):
    from train_lad import config as lad_config  # noqa: PLC0415
    from train_lad.data import load_base_model  # noqa: PLC0415
    from train_lad.stamp import stamp  # noqa: PLC0415
    lad = _copy_drafter(tmp_path)
    path = os.path.join(lad, DRAFTER_FILE)
    cfg = lad_config.get("tiny_ouro")
    model, _ = load_base_model(cfg, os.path.join(REPO, "checkpoints", "tiny_ouro"))
    set_base_digest(path, "0123456789abcdef")
    with safe_open(path, "numpy") as f:
        before = {k: f.get_tensor(k) for k in f.keys()}
    info = stamp(cfg, lad, model=model)
    assert info["base_digest"] == params_digest(model) == LadDrafter.load(lad).base_digest
    assert info["record"] == "lad_config.json matches"
    with safe_open(path, "numpy") as f:
        assert sorted(f.keys()) == sorted(before)
        for k in before:
            np.testing.assert_array_equal(f.get_tensor(k), before[k])
    # a training record naming another model: refused, the file left as it was
    record = json.loads(open(os.path.join(lad, "lad_config.json")).read())
    record["base"]["params_sha256"] = "fedcba9876543210"
    with open(os.path.join(lad, "lad_config.json"), "w") as f:
        json.dump(record, f)
    set_base_digest(path, "0123456789abcdef")
    with pytest.raises(ConfigError, match="trained on another model"):
        stamp(cfg, lad, model=model)
    assert LadDrafter.load(lad).base_digest == "0123456789abcdef"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_drafters_record_their_shipped_models(name):
    """Every shipped drafter records a base model; for the tiny ones (no SmolLM2 needed) it is
    the shipped preset's model. (`train_lad.stamp` checked each against its training record
    before recording it; the SmolLM2-made ones are checked end to end in test_recursive.)"""
    drafter = LadDrafter.load(os.path.join(REPO, "checkpoints", name))
    assert drafter.base_digest is not None
    if name in TINY:
        from train_lad import config as lad_config  # noqa: PLC0415
        from train_lad.data import load_base_model  # noqa: PLC0415
        model, _ = load_base_model(lad_config.get(name[:-len("_lad")]))
        assert drafter.base_digest == params_digest(model)


def test_stamp_command_line(tmp_path):
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    lad = _copy_drafter(tmp_path)
    set_base_digest(os.path.join(lad, DRAFTER_FILE), "0123456789abcdef")
    cmd = [sys.executable, "-m", "train_lad.stamp", "--config=tiny_ouro"]
    got = subprocess.run([*cmd, f"--lad={lad}"], cwd=REPO, capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout.splitlines()[-1])["base_digest"] == LadDrafter.load(
        lad).base_digest != "0123456789abcdef"
    bad = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "error: --lad" in bad.stderr


def test_calibrate_command_line(tmp_path):
    """train_lad.calibrate, the other command over a written drafter (the same flags, through
    train_lad.cli): it replaces the file's calibration with one at the given temperatures and
    bins, keeps every other tensor and the recorded model, and fails clearly without --lad."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    lad = _copy_drafter(tmp_path)
    before = LadDrafter.load(lad)
    cmd = [sys.executable, "-m", "train_lad.calibrate", "--config=tiny_ouro"]
    got = subprocess.run([*cmd, f"--lad={lad}", "--temperatures=0.9", "--bins=4"], cwd=REPO,
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert list(json.loads(got.stdout.splitlines()[-1])["mean_match"]) == ["0.9"]
    after = LadDrafter.load(lad)
    assert after.calibration.temperatures.tolist() == [np.float32(0.9)]
    assert after.calibration.table.shape == (1, before.calibration.table.shape[1], 4)
    assert after.base_digest == before.base_digest
    kept = {k: v for k, v in before.params.items() if k != "calibration"}
    assert set(after.params) == {*kept, "calibration"}
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(
            {k: after.params[k] for k in kept})):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bad = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "error: --lad" in bad.stderr
