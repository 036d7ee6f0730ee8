"""train_lad on a tiny random looped model: the teacher data are the model's own greedy
continuations and early-loop states; the drafter trains (the loss falls, the frozen model's
parameters never change), is selected on the development split, resumes from its last
checkpoint exactly as if never stopped, and a looped model or workdir that does not match the
drafter's config is refused with a clear error."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import ConfigError
from models.looped import LoopedLM
from test_looped import CONFIGS, _perturb_norms  # noqa: E402
from train_lad import config as lad_config
from train_lad import data as lad_data
from train_lad.main import base_fingerprint, load_base_model, run
from train_lad.train import load_drafter, targets

CFG = lad_config.LadConfig(
    name="test", model_preset="tiny_ouro", model_family="ouro", model_hidden=32,
    model_vocab=97, model_loops=3, draft_depth=1, K=2, hidden_size=32, num_layers=1,
    num_heads=2, draft_vocab=64, prompt_len=6, continuation=10, num_train=24, num_dev=8,
    num_confirm=8, prompt_source="random", batch_size=8, steps=8, eval_every=4, lr=3e-3)


@pytest.fixture(scope="module")
def model():
    return _perturb_norms(LoopedLM(CONFIGS["ouro"], rngs=nnx.Rngs(3)))


def _losses(workdir):
    with open(workdir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def test_teacher_data(model):
    prompts = [[5, 9, 11, 3, 4, 6], [7, 8, 1, 2, 3, 4]]
    d = lad_data.teacher_data(model, prompts, continuation=5, draft_depth=1)
    assert d["tokens"].shape == (2, 11) and d["states"].shape == (2, 11, 32)
    # the continuation is the model's full-depth greedy output; native = depth-1 argmax
    logits, _ = model.loop_logits(jnp.asarray(d["tokens"]),
                                  jnp.broadcast_to(jnp.arange(11), (2, 11)))
    full = np.asarray(jnp.argmax(logits[-1], -1))
    np.testing.assert_array_equal(d["tokens"][:, 6:], full[:, 5:10])
    np.testing.assert_array_equal(d["native"], np.asarray(jnp.argmax(logits[0], -1)))


def test_targets_and_vocab():
    tokens = jnp.asarray([[1, 2, 3, 4, 5, 6]])
    native = jnp.asarray([[2, 9, 4, 5, 6, 0]])  # right at t = 0, 2, 3, 4
    table = jnp.asarray(lad_data.to_draft_ids(np.asarray([3, 4, 5, 6]), 10))
    tgt, valid, ok = targets(tokens, native, table, prompt_len=2, K=2)
    assert ok.tolist() == [[False, False, True, True, True, False]]  # counted from t = 1
    assert tgt[0, 2].tolist() == [2, 3]  # tokens 5, 6 -> draft ids 2, 3
    assert valid[0, 2].tolist() == [True, True] and valid[0, 3].tolist() == [True, False]
    vocab = lad_data.draft_vocabulary(np.asarray([[0, 0, 7, 7, 7, 5]]), 2, 2, 10, always=(1,))
    assert vocab.tolist() == [1, 7]


def test_eval_filter():
    f = lad_data.EvalFilter(["How many clips did Natalia sell altogether in April and May?"])
    assert not f.clean("Q: how many clips did natalia sell altogether in april and may? A:")
    assert not f.clean("clips did Natalia sell altogether in April")  # near duplicate
    assert f.clean("Natalia sold clips to her friends in April.")
    assert {lad_data.split_of(f"doc/{i}") for i in range(200)} == set(lad_data.SPLITS)


def test_train_select_resume(model, tmp_path):
    before = jnp.concatenate([x.ravel() for x in jax.tree.leaves(nnx.state(model, nnx.Param))])
    full = run(CFG, tmp_path / "full", model=model, progress_bar=False, log=lambda m: None)
    after = jnp.concatenate([x.ravel() for x in jax.tree.leaves(nnx.state(model, nnx.Param))])
    assert bool((before == after).all())  # the looped model is frozen
    losses = _losses(tmp_path / "full")
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1]
    assert full["best_step"] in (4, 8) and full["dev_accepted_prefix"] >= 0
    assert "confirm_accepted_prefix" in full
    drafter, vocab = load_drafter(tmp_path / "full", CFG)
    assert drafter.shape.K == 2 and len(vocab) <= 64

    # stopped after 3 steps, then run again: resumes at step 3, same losses as never stopped
    logs = []
    run(CFG, tmp_path / "split", model=model, progress_bar=False, log=logs.append,
        max_steps_now=3)
    assert sorted(_losses(tmp_path / "split")) == [1, 2, 3]
    run(CFG, tmp_path / "split", model=model, progress_bar=False, log=logs.append)
    assert any("resumed from step 3" in m for m in logs), logs
    split = _losses(tmp_path / "split")
    assert sorted(split) == list(range(1, 9))
    np.testing.assert_allclose([split[s] for s in range(1, 9)],
                               [losses[s] for s in range(1, 9)], rtol=1e-5)


def test_mismatched_model_is_refused(model, tmp_path):
    raven_cfg = dataclasses.replace(CFG, model_preset="tiny_raven", model_ckpt="random")
    with pytest.raises(ConfigError, match="family is raven in the checkpoint, ouro"):
        load_base_model(raven_cfg)
    with pytest.raises(ConfigError, match="hidden_size is 32 in the checkpoint, 64"):
        run(dataclasses.replace(CFG, model_hidden=64), tmp_path / "w", model=model,
            progress_bar=False, log=lambda m: None)
    # a workdir trained on one model refuses another of the same shape
    run(dataclasses.replace(CFG, steps=4), tmp_path / "x", model=model, progress_bar=False,
        log=lambda m: None)
    other = _perturb_norms(LoopedLM(CONFIGS["ouro"], rngs=nnx.Rngs(4)))
    assert base_fingerprint(other) != base_fingerprint(model)
    with pytest.raises(ConfigError, match="another looped model"):
        run(CFG, tmp_path / "x", model=other, progress_bar=False, log=lambda m: None)


def test_model_head_scores_the_request_tokens(model, tmp_path):
    """head="model": the drafter trains against the frozen model's output embedding (the loss
    falls); at inference each drafted token is the argmax over the draft vocabulary plus the
    extra tokens, of the same scores a full-vocabulary readout gives them, so tokens outside
    the draft vocabulary (here: the prompt's) are drafted; a "vocab" head ignores them."""
    from lookahead_jax.loopahead import LadDrafter  # noqa: PLC0415
    from train_lad.model import output_embedding  # noqa: PLC0415
    cfg = dataclasses.replace(CFG, head="model")
    run(cfg, tmp_path / "m", model=model, progress_bar=False, log=lambda m: None)
    losses = _losses(tmp_path / "m")
    assert losses[8] < losses[1]
    net, vocab = load_drafter(tmp_path / "m", cfg)
    assert net.shape.head == "model" and len(vocab) <= 64
    drafter = LadDrafter(net, vocab)
    rng = np.random.default_rng(0)
    b, w, e = 16, 6, CFG.model_hidden
    states = jnp.asarray(rng.normal(size=(b, w, e)), jnp.float32)
    anchors = jnp.asarray(rng.integers(0, 97, (b, w)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((w, w), bool)), (b, w, w))
    extra = jnp.asarray(np.where(rng.random((b, 12)) < 0.8, rng.integers(0, 97, (b, 12)), -1),
                        jnp.int32)
    table = output_embedding(model)
    got = np.asarray(drafter.draft(drafter.params, states, anchors, pos, mask, extra_ids=extra,
                                   out_embedding=table))
    full = np.asarray(jnp.einsum("bke,ev->bkv", net.features(states, anchors, pos, mask)[:, -1],
                                 table))  # [B, K, V]: every token's score
    for i in range(b):
        allowed = np.zeros(97, bool)
        allowed[np.asarray(vocab)] = True
        allowed[[t for t in np.asarray(extra[i]) if t >= 0]] = True
        want = np.where(allowed[None], full[i], -np.inf).argmax(-1)
        assert got[i].tolist() == want.tolist()
    outside = ~np.isin(got, np.asarray(vocab))
    assert outside.any()  # drafted from the extra tokens
    from train_lad.model import DrafterShape, LookaheadDrafter  # noqa: PLC0415
    own = LadDrafter(LookaheadDrafter(DrafterShape(e, 97, 32, 1, 2, 2, len(vocab)),
                                      rngs=nnx.Rngs(0)), vocab)
    plain = own.draft(own.params, states, anchors, pos, mask)
    with_extra = own.draft(own.params, states, anchors, pos, mask, extra_ids=extra,
                           out_embedding=table)
    assert with_extra.tolist() == plain.tolist()
    assert np.isin(np.asarray(plain), np.asarray(vocab)).all()


@pytest.mark.parametrize("name", sorted(lad_config.CONFIGS))
def test_shipped_lad_configs_match_their_presets(name):
    """Each drafter config fits the looped model its preset ships (checkpoints/<name>), and
    the same check refuses the other tiny model."""
    from lookahead_jax.presets import load_preset  # noqa: PLC0415
    cfg = lad_config.get(name)
    lad_config.check_base_model(cfg, load_preset(cfg.model_preset).model, cfg.model_preset)
    other = next(n for n in sorted(lad_config.CONFIGS) if n != name)
    with pytest.raises(ConfigError, match="does not match lad config"):
        lad_config.check_base_model(cfg, load_preset(other).model, other)


@pytest.mark.parametrize("layers,head", [(1, "vocab"), (2, "model")])
def test_last_only_features_equal_the_full_pass_at_the_last_position(layers, head):
    """Decoding asks for the last position's drafts only; the shortcut (the last layer's
    queries and MLP for that position alone) gives the full pass's values there, with a
    window mask that hides some positions."""
    from train_lad.model import DrafterShape, LookaheadDrafter  # noqa: PLC0415
    shape = DrafterShape(state_size=24, vocab_size=50, hidden_size=32, num_layers=layers,
                         num_heads=2, K=3, draft_vocab=40, head=head)
    net = LookaheadDrafter(shape, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    b, t = 2, 7
    states = jnp.asarray(rng.normal(size=(b, t, 24)), jnp.float32)
    anchors = jnp.asarray(rng.integers(0, 50, (b, t)), jnp.int32)
    positions = jnp.asarray(np.arange(t)[None] + np.array([[0], [5]]), jnp.int32)
    ok = jnp.asarray(rng.random((b, t)) > 0.3).at[:, -1].set(True)
    mask = jnp.tril(jnp.ones((t, t), bool))[None] & ok[:, None, :] & ok[:, :, None]
    mask = mask | jnp.eye(t, dtype=bool)[None]
    full = net.features(states, anchors, positions, mask)
    last = net.features(states, anchors, positions, mask, last_only=True)
    assert last.shape == (b, 1, 3, full.shape[-1])
    np.testing.assert_allclose(last[:, 0], full[:, -1], rtol=2e-5, atol=2e-5)
