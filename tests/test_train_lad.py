"""train_lad on a tiny random looped model: the teacher data are the model's own greedy
continuations and early-loop states; the drafter trains (the loss falls, the frozen model's
parameters never change), is selected on the development split, resumes from its last
checkpoint exactly as if never stopped, is written as a drafter file (`drafter.safetensors`)
that decoding loads without the training code, and a looped model or workdir that does not
match the drafter's config is refused with a clear error."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from models.build import build_looped
from models.config import ConfigError
from test_looped import CONFIGS, _perturb_norms  # noqa: E402
from train_lad import config as lad_config
from train_lad import data as lad_data
from lookahead_jax.looped.drafter import (DrafterShape, LadDrafter, LookaheadDrafter,
                                          load_drafter_file, params_digest,
                                          save_drafter_file)
from train_lad.main import base_fingerprint, load_base_model, run
from train_lad.train import evaluate, targets

CFG = lad_config.LadConfig(
    name="test", model_preset="tiny_ouro", model_family="ouro", model_hidden=32,
    model_vocab=97, model_loops=3, draft_depth=1, K=2, hidden_size=32, num_layers=1,
    num_heads=2, draft_vocab=64, prompt_len=6, continuation=10, num_train=24, num_dev=8,
    num_confirm=8, prompt_source="random", batch_size=8, steps=8, eval_every=4, lr=3e-3,
    arch="heads")  # (test_the_papers_drafter_trains trains the paper's "queries")


@pytest.fixture(scope="module")
def model():
    return _perturb_norms(build_looped(CONFIGS["ouro"], rngs=nnx.Rngs(3)))


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


def _dev_data(workdir) -> dict:
    z = np.load(workdir / "data.npz")
    return {k: z[f"dev_{k}"] for k in ("tokens", "states", "native")}


def _accepted_prefix(drafter: LadDrafter, data: dict, prompt_len: int) -> float:
    """The average accepted prefix (anchor included) of a drafter over a split, recomputed in
    numpy from its full-pass drafts: at each position t from the last prompt token to T - 2,
    0 if the anchor (native[t]) is not token t + 1, else 1 + the leading drafted tokens equal
    to tokens t + 2 ...."""
    net = nnx.merge(drafter.graphdef, drafter.params["net"])
    vocab = np.asarray(drafter.params["vocab"])
    tokens, native = data["tokens"], data["native"]
    n, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (n, t, t))
    drafted = vocab[np.asarray(jnp.argmax(net(jnp.asarray(data["states"], jnp.float32),
                                              jnp.asarray(native), pos, mask), -1))]
    total = count = 0
    for i in range(n):
        for p in range(prompt_len - 1, t - 1):
            count += 1
            if native[i, p] != tokens[i, p + 1]:
                continue
            total += 1
            for k in range(drafted.shape[2]):
                if p + 2 + k >= t or drafted[i, p, k] != tokens[i, p + 2 + k]:
                    break
                total += 1
    return total / count


def _drafts(drafter: LadDrafter, seed: int = 0, **kw) -> np.ndarray:
    rng = np.random.default_rng(seed)
    b, w = 4, 6
    e = nnx.merge(drafter.graphdef, drafter.params["net"]).shape.state_size
    states = jnp.asarray(rng.normal(size=(b, w, e)), jnp.float32)
    anchors = jnp.asarray(rng.integers(0, 97, (b, w)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((w, w), bool)), (b, w, w))
    return np.asarray(drafter.draft(drafter.params, states, anchors, pos, mask, **kw))


def test_train_select_resume(model, tmp_path):
    before = jnp.concatenate([x.ravel() for x in jax.tree.leaves(nnx.state(model, nnx.Param))])
    full = run(CFG, tmp_path / "full", model=model, progress_bar=False, log=lambda m: None)
    after = jnp.concatenate([x.ravel() for x in jax.tree.leaves(nnx.state(model, nnx.Param))])
    assert bool((before == after).all())  # the looped model is frozen
    losses = _losses(tmp_path / "full")
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1]
    assert full["best_step"] in (4, 8)
    assert "confirm_accepted_prefix" in full
    # the run wrote the selected drafter as a drafter file, which decoding loads
    drafter = LadDrafter.load(tmp_path / "full", model.config)
    assert (drafter.K, drafter.head, drafter.arch, drafter.draft_depth) == (2, "vocab",
                                                                             "heads", 1)
    assert drafter.base_digest == params_digest(model)  # it records the model it drafts for
    # calibrated for sampling on the development split
    assert drafter.calibration.table.shape == (3, 2, 10) and "calibration" in full
    assert len(drafter.params["vocab"]) <= 64
    # the reported dev figure is the best one logged, and the file's drafter's, recomputed
    # independently (the file holds the selected checkpoint)
    with open(tmp_path / "full" / "metrics.jsonl") as f:
        logged = [r["dev_accepted_prefix"] for r in map(json.loads, f)
                  if "dev_accepted_prefix" in r]
    assert len(logged) == 2 and full["dev_accepted_prefix"] == max(logged)
    dev = _dev_data(tmp_path / "full")
    np.testing.assert_allclose(_accepted_prefix(drafter, dev, CFG.prompt_len),
                               full["dev_accepted_prefix"], rtol=1e-6)
    # the metric's drafted-token part too: with every anchor right (this random model's rarely
    # are), train_lad's figure and the recomputed one agree, above the anchors' 1
    right = {**dev, "native": np.concatenate([dev["tokens"][:, 1:], dev["tokens"][:, -1:]], 1)}
    vocab = np.asarray(drafter.params["vocab"])
    got = evaluate(drafter.params["net"], drafter.graphdef, right,
                   jnp.asarray(lad_data.to_draft_ids(vocab, CFG.model_vocab)), CFG)
    want = _accepted_prefix(drafter, right, CFG.prompt_len)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert want > 1.0

    # stopped after 3 steps, then run again: resumes at step 3, same losses as never stopped
    logs = []
    run(CFG, tmp_path / "split", model=model, progress_bar=False, log=logs.append,
        max_steps_now=3)
    assert sorted(_losses(tmp_path / "split")) == [1, 2, 3]
    assert not (tmp_path / "split" / "drafter.safetensors").exists()  # not finished
    with pytest.raises(ConfigError, match="has not finished"):
        LadDrafter.load(tmp_path / "split")
    run(CFG, tmp_path / "split", model=model, progress_bar=False, log=logs.append)
    assert any("resumed from step 3" in m for m in logs), logs
    split = _losses(tmp_path / "split")
    assert sorted(split) == list(range(1, 9))
    np.testing.assert_allclose([split[s] for s in range(1, 9)],
                               [losses[s] for s in range(1, 9)], rtol=1e-5)
    assert _drafts(LadDrafter.load(tmp_path / "split")).tolist() == _drafts(drafter).tolist()

    # a finished run, run again, trains no further and writes the drafter file again
    (tmp_path / "full" / "drafter.safetensors").unlink()
    logs = []
    run(CFG, tmp_path / "full", model=model, progress_bar=False, log=logs.append)
    assert any("resumed from step 8" in m for m in logs), logs
    assert sorted(_losses(tmp_path / "full")) == list(range(1, 9))
    assert _drafts(LadDrafter.load(tmp_path / "full")).tolist() == _drafts(drafter).tolist()


@pytest.mark.parametrize("head,arch,anchor,residual", [("vocab", "heads", "table", 0),
                                                       ("model", "heads", "table", 0),
                                                       ("model", "queries", "table", 0),
                                                       ("vocab", "queries", "model", 0),
                                                       ("model", "queries", "model", 6)])
def test_drafter_file_round_trip(tmp_path, head, arch, anchor, residual):
    """save_drafter_file then load_drafter_file (or LadDrafter.load of the file): the same
    parameters, vocabulary, arch, anchor, residual head and depths, so the same drafts."""
    shape = DrafterShape(state_size=32, vocab_size=97, hidden_size=32, num_layers=2,
                         num_heads=2, K=3, draft_vocab=40, head=head, arch=arch, anchor=anchor,
                         residual=residual)
    vocab = np.sort(np.random.default_rng(1).choice(97, 40, replace=False)).astype(np.int32)
    net = LookaheadDrafter(shape, rngs=nnx.Rngs(5))
    if residual:
        net.residual_up.kernel[...] = jnp.full_like(net.residual_up.kernel[...], 0.1)
    path = tmp_path / "d.safetensors"
    backbone = 1 if residual else None
    if residual:
        with pytest.raises(ValueError, match="needs its backbone_depth"):
            save_drafter_file(path, net, vocab, draft_depth=2, model_family="ouro",
                              model_loops=3)
    save_drafter_file(path, net, vocab, draft_depth=2, model_family="ouro", model_loops=3,
                      backbone_depth=backbone)
    got = load_drafter_file(path, CONFIGS["ouro"])
    assert (got.K, got.head, got.arch, got.anchor, got.draft_depth) == (3, head, arch, anchor, 2)
    assert (got.residual, got.backbone_depth) == (residual, backbone or 2)
    assert got.calibration is None
    if residual:  # a calibration added to the file; everything else stays as it was
        from lookahead_jax.looped.drafter import Calibration, add_calibration  # noqa: PLC0415
        cal = Calibration(np.asarray([0.7, 1.0], np.float32),
                          np.random.default_rng(3).random((2, 3, 5)).astype(np.float32))
        add_calibration(path, cal)
        again = load_drafter_file(path, CONFIGS["ouro"])
        np.testing.assert_array_equal(again.calibration.table, cal.table)
        np.testing.assert_array_equal(again.calibration.temperatures, cal.temperatures)
        for a, b in zip(jax.tree.leaves(got.params["net"]), jax.tree.leaves(again.params["net"])):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(ValueError, match="a table for K = 2"):
            add_calibration(path, Calibration(cal.temperatures, cal.table[:, :2]))
    assert np.asarray(got.params["vocab"]).tolist() == vocab.tolist()
    for a, b in zip(jax.tree.leaves(nnx.state(net)), jax.tree.leaves(got.params["net"])):
        np.testing.assert_array_equal(a, b)
    want = LadDrafter(net, vocab, draft_depth=2, backbone_depth=backbone)
    kw = {}
    rng = np.random.default_rng(2)
    if head == "model":
        kw = dict(extra_ids=jnp.asarray(rng.integers(-1, 97, (4, 5)), jnp.int32))
    if shape.needs_embedding:
        kw["out_embedding"] = jnp.asarray(rng.normal(size=(32, 97)), jnp.float32)
    assert _drafts(got, **kw).tolist() == _drafts(want, **kw).tolist()
    assert _drafts(LadDrafter.load(path), **kw).tolist() == _drafts(want, **kw).tolist()


def test_residual_head_trains_over_a_frozen_backbone(model, tmp_path):
    """Raven's residual head: a backbone drafter trained on loop 1's states, then a config
    with a residual head at draft_depth 2 over it. Only the head trains (the backbone's
    parameters and draft vocabulary come out unchanged, its loss falls); the head starts as
    the backbone (its zero `up` projection adds nothing: the ablation figure
    `backbone_dev_accepted_prefix` is the backbone's on loop 2's states); the file records
    both depths and decoding loads it at depth 2; a backbone of another shape, and a residual
    head without a backbone, are refused."""
    base = dataclasses.replace(CFG, arch="queries", head="model")
    run(base, tmp_path / "b", model=model, progress_bar=False, log=lambda m: None)
    backbone = LadDrafter.load(tmp_path / "b", model.config)
    cfg = dataclasses.replace(base, draft_depth=2, residual=8, backbone=str(tmp_path / "b"),
                              lr=1e-2)
    summary = run(cfg, tmp_path / "r", model=model, progress_bar=False, log=lambda m: None)
    losses = _losses(tmp_path / "r")
    assert losses[8] < losses[1]
    assert summary["backbone_depth"] == 1
    got = LadDrafter.load(tmp_path / "r", model.config)
    assert (got.draft_depth, got.backbone_depth, got.residual) == (2, 1, 8)
    assert np.asarray(got.params["vocab"]).tolist() == np.asarray(
        backbone.params["vocab"]).tolist()
    with safe_open(str(tmp_path / "r" / "drafter.safetensors"), "numpy") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert (meta["draft_depth"], meta["backbone_depth"], meta["residual"]) == ("2", "1", "8")
    flat_b = {".".join(map(str, p)): v.get_value()
              for p, v in nnx.to_flat_state(backbone.params["net"])}
    for name, value in flat_b.items():  # the backbone is frozen
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    assert np.abs(tensors["residual_up.kernel"]).max() > 0  # the head trained
    # with its `up` projection at zero the network is the backbone (the head's start)
    net = nnx.merge(got.graphdef, got.params["net"])
    net.residual_up.kernel[...] = jnp.zeros_like(net.residual_up.kernel[...])
    net.residual_up.bias[...] = jnp.zeros_like(net.residual_up.bias[...])
    from lookahead_jax.looped.drafter import output_embedding  # noqa: PLC0415
    emb = output_embedding(model)
    states, anchors, pos, mask = _window(3, 6, 97)
    bnet = nnx.merge(backbone.graphdef, backbone.params["net"])
    np.testing.assert_allclose(np.asarray(net.features(states, anchors, pos, mask,
                                                       embedding=emb)),
                               np.asarray(bnet.features(states, anchors, pos, mask,
                                                        embedding=emb)), rtol=1e-6, atol=1e-6)
    # the backbone alone on loop 2's data, recomputed
    dev = _dev_data(tmp_path / "r")
    vocab = np.asarray(backbone.params["vocab"])
    want = evaluate(backbone.params["net"], backbone.graphdef, dev,
                    jnp.asarray(lad_data.to_draft_ids(vocab, CFG.model_vocab)), cfg,
                    out_emb=emb[:, vocab])
    np.testing.assert_allclose(summary["backbone_dev_accepted_prefix"], want, rtol=1e-6)
    with pytest.raises(ConfigError, match="backbone's hidden_size is 32, the config's 16"):
        run(dataclasses.replace(cfg, hidden_size=16), tmp_path / "x", model=model,
            progress_bar=False, log=lambda m: None)
    with pytest.raises(ConfigError, match="residual head .* and a backbone go together"):
        dataclasses.replace(cfg, backbone=None)


def test_calibration_measures_match_probabilities():
    """train_lad.calibrate on a hand-made row: the k-th draft at position t is scored by the
    full-depth target at position t + k (temperature-warped), counted only where the anchor
    and the earlier drafts equal the continuation and the drafted token lies inside the row;
    each confidence bin holds its mean shrunk to the k's mean (here every sample of a k falls
    in one bin, so all its bins hold that mean)."""
    from train_lad.calibrate import calibrate  # noqa: PLC0415
    tokens = np.asarray([[0, 1, 2, 3, 0, 1]])
    native = np.asarray([[9, 2, 3, 9, 1, 9]])  # right at t = 1, 2, 4
    drafted = np.asarray([[[0, 0], [3, 0], [1, 1], [0, 0], [2, 2], [0, 0]]])  # t=1: both right
    conf = np.asarray([[[0.5, 0.5], [0.95, 0.15], [0.95, 0.5], [0.5, 0.5], [0.9, 0.9],
                        [0.5, 0.5]]])
    probs = np.full((1, 6, 4), 0.25)
    probs[0, 2] = [0.1, 0.2, 0.3, 0.4]
    probs[0, 3] = [0.5, 0.25, 0.15, 0.1]
    cal, info = calibrate(drafted, conf, tokens, native, np.log(probs), prompt_len=2,
                          temperatures=(0.5, 1.0), bins=2)
    # k = 1: t = 1 (p[2][3]) and t = 2 (p[3][1]); t = 4 would draft token 6, past the row.
    # k = 2: t = 1 only (its first draft is right): p[3][0]
    sq2, sq3 = probs[0, 2] ** 2 / (probs[0, 2] ** 2).sum(), probs[0, 3] ** 2 / (
        probs[0, 3] ** 2).sum()
    want = np.asarray([[[(sq2[3] + sq3[1]) / 2] * 2, [sq3[0]] * 2],
                       [[(0.4 + 0.25) / 2] * 2, [0.5] * 2]])
    np.testing.assert_allclose(cal.table, want, rtol=1e-5)
    assert info["samples_per_k"] == [2, 1]


def test_drafter_file_in_float16(tmp_path):
    """dtype="float16": the file stores each parameter in half precision (smaller file) and
    loading gives the float32 network with exactly the float16-rounded parameters, so the
    drafts of a network rounded the same way in memory."""
    shape = DrafterShape(state_size=32, vocab_size=97, hidden_size=32, num_layers=2,
                         num_heads=2, K=3, draft_vocab=40, arch="queries", anchor="model")
    vocab = np.arange(40, dtype=np.int32)
    net = LookaheadDrafter(shape, rngs=nnx.Rngs(7))
    full, half = tmp_path / "f32.safetensors", tmp_path / "f16.safetensors"
    save_drafter_file(full, net, vocab, draft_depth=1, model_family="ouro", model_loops=3)
    save_drafter_file(half, net, vocab, draft_depth=1, model_family="ouro", model_loops=3,
                      dtype="float16")
    assert half.stat().st_size < 0.6 * full.stat().st_size
    got = load_drafter_file(half, CONFIGS["ouro"])
    rounded = jax.tree.map(lambda x: x.astype(jnp.float16).astype(x.dtype), nnx.state(net))
    changed = False
    for a, b, c in zip(jax.tree.leaves(rounded), jax.tree.leaves(got.params["net"]),
                       jax.tree.leaves(nnx.state(net))):
        assert b.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)
        changed |= bool(np.any(np.asarray(b) != np.asarray(c)))
    assert changed  # the rounding is real, so the equality above is not vacuous
    nnx.update(net, rounded)
    emb = jnp.asarray(np.random.default_rng(3).normal(size=(32, 97)), jnp.float32)
    want = LadDrafter(net, vocab, draft_depth=1)
    assert (_drafts(got, out_embedding=emb).tolist()
            == _drafts(want, out_embedding=emb).tolist())


def test_drafter_file_refuses_another_model_and_a_damaged_file(tmp_path):
    """A drafter file is refused, with the field named, for a looped model it was not trained
    for; a file whose tensors do not fit its own metadata is refused naming the tensor; a
    path that is no drafter file or finished train_lad workdir gets a clear error."""
    from safetensors.numpy import load_file, save_file  # noqa: PLC0415
    net = LookaheadDrafter(DrafterShape(32, 97, 32, 1, 2, 2, 16), rngs=nnx.Rngs(0))
    path = tmp_path / "d.safetensors"
    save_drafter_file(path, net, np.arange(16), draft_depth=2, model_family="ouro",
                      model_loops=3)
    ouro = CONFIGS["ouro"]
    load_drafter_file(path, ouro)  # fits
    for field, value, message in (("hidden_size", 64, "hidden_size is 64 in the model, 32"),
                                  ("vocab_size", 100, "vocab_size is 100 in the model, 97"),
                                  ("num_loops", 2, "num_loops is 2")):
        with pytest.raises(ConfigError, match=message):
            load_drafter_file(path, dataclasses.replace(ouro, **{field: value}))
    with pytest.raises(ConfigError, match="family is raven in the model, ouro"):
        LadDrafter.load(path, CONFIGS["raven"])
    with pytest.raises(ConfigError, match="not one"):  # a plain (non-looped) model
        load_drafter_file(path, object())

    tensors = load_file(path)
    tensors["state_proj.kernel"] = tensors["state_proj.kernel"][:, :16]
    from safetensors import safe_open  # noqa: PLC0415
    with safe_open(path, "numpy") as f:
        meta = f.metadata()
    save_file(tensors, tmp_path / "bad.safetensors", metadata=meta)
    with pytest.raises(ConfigError, match=r"state_proj.kernel has shape \(32, 16\)"):
        load_drafter_file(tmp_path / "bad.safetensors")
    del tensors["state_proj.kernel"]
    save_file(tensors, tmp_path / "bad.safetensors", metadata=meta)
    with pytest.raises(ConfigError, match="missing: state_proj.kernel"):
        load_drafter_file(tmp_path / "bad.safetensors")
    # a file written before the "queries" arch (no arch metadata) holds a "heads" drafter
    old = {k: v for k, v in meta.items() if k != "arch"}
    save_file(load_file(path), tmp_path / "old.safetensors", metadata=old)
    assert load_drafter_file(tmp_path / "old.safetensors").arch == "heads"
    save_file(load_file(path), tmp_path / "bad.safetensors", metadata={**meta, "arch": "tree"})
    with pytest.raises(ConfigError, match="metadata arch is 'tree'"):
        load_drafter_file(tmp_path / "bad.safetensors")
    save_file(load_file(path), tmp_path / "other.safetensors",
              metadata={**meta, "arch": "queries"})  # a heads file that says queries
    with pytest.raises(ConfigError, match="missing: query_embed, query_head"):
        load_drafter_file(tmp_path / "other.safetensors")
    save_file(load_file(path), tmp_path / "nometa.safetensors")
    with pytest.raises(ConfigError, match="format"):
        load_drafter_file(tmp_path / "nometa.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        LadDrafter.load(tmp_path / "junk.safetensors")
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "absent", tmp_path / "data.npz"):
        if bad.name == "data.npz":
            bad.write_bytes(b"")
        with pytest.raises(ConfigError, match="python -m train_lad.main"):
            LadDrafter.load(bad)


def test_drafter_module_imports_no_training_code():
    """Decoding loads drafters without the training code or its libraries."""
    import lookahead_jax.looped.drafter as drafter  # noqa: PLC0415
    tree = ast.parse(pathlib.Path(drafter.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "safetensors" in {n.split(".")[0] for n in names}
    banned = ("train_lad", "train_looped", "benchmarks", "optax", "orbax")
    assert not [n for n in names if n.split(".")[0] in banned], names


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
    other = _perturb_norms(build_looped(CONFIGS["ouro"], rngs=nnx.Rngs(4)))
    assert base_fingerprint(other) != base_fingerprint(model)
    with pytest.raises(ConfigError, match="another looped model"):
        run(CFG, tmp_path / "x", model=other, progress_bar=False, log=lambda m: None)
    # ... and a drafter of another arch (its checkpoints would not fit)
    with pytest.raises(ConfigError, match="arch = 'heads', this one 'queries'"):
        run(dataclasses.replace(CFG, steps=4, arch="queries"), tmp_path / "x", model=model,
            progress_bar=False, log=lambda m: None)


def _window(b: int, w: int, anchors_below: int):
    """A random causal drafting window: states [b,w,E], anchors < anchors_below, positions,
    mask."""
    rng = np.random.default_rng(0)
    states = jnp.asarray(rng.normal(size=(b, w, CFG.model_hidden)), jnp.float32)
    anchors = jnp.asarray(rng.integers(0, anchors_below, (b, w)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((w, w), bool)), (b, w, w))
    return states, anchors, pos, mask


def test_the_papers_drafter_trains(model, tmp_path):
    """arch "queries" (K future query positions, the LAD default) through train_lad: the loss
    falls, the drafter file says its arch, and decoding's drafts are the argmax of its last
    position's query outputs."""
    cfg = dataclasses.replace(CFG, arch="queries")
    run(cfg, tmp_path / "q", model=model, progress_bar=False, log=lambda m: None)
    losses = _losses(tmp_path / "q")
    assert losses[8] < losses[1]
    drafter = LadDrafter.load(tmp_path / "q", model.config)
    assert drafter.arch == "queries" and drafter.K == 2
    net = nnx.merge(drafter.graphdef, drafter.params["net"])
    states, anchors, pos, mask = _window(4, 6, 97)
    want = np.asarray(drafter.params["vocab"])[
        np.asarray(net.features(states, anchors, pos, mask)[:, -1].argmax(-1))]
    got = drafter.draft(drafter.params, states, anchors, pos, mask)
    assert np.asarray(got).tolist() == want.tolist()


def test_model_anchor_embeds_anchors_through_the_models_embedding(model, tmp_path):
    """anchor="model": no vocabulary-sized table in the drafter (its file holds the projection
    alone); the drafter trains (the loss falls); an anchor is embedded as its column of the
    output embedding it is given, so changing another token's column changes nothing and
    changing the anchor's changes the drafts' scores; without the embedding it is refused;
    a workdir trained with a table anchor is refused."""
    from lookahead_jax.looped.drafter import output_embedding  # noqa: PLC0415
    cfg = dataclasses.replace(CFG, anchor="model")
    run(cfg, tmp_path / "a", model=model, progress_bar=False, log=lambda m: None)
    losses = _losses(tmp_path / "a")
    assert losses[8] < losses[1]
    drafter = LadDrafter.load(tmp_path / "a", model.config)
    assert drafter.anchor == "model"
    with safe_open(str(tmp_path / "a" / "drafter.safetensors"), "numpy") as f:
        names = set(f.keys())
        assert f.metadata()["anchor"] == "model"
    assert "anchor_proj.kernel" in names and not any("anchor_embed" in n for n in names)
    net = nnx.merge(drafter.graphdef, drafter.params["net"])
    states, anchors, pos, mask = _window(2, 5, 50)
    table = output_embedding(model)
    base = np.asarray(net.features(states, anchors, pos, mask, embedding=table))
    unused = table.at[:, 96].set(5.0)  # token 96 is no anchor here
    np.testing.assert_array_equal(
        np.asarray(net.features(states, anchors, pos, mask, embedding=unused)), base)
    moved = table.at[:, int(anchors[0, -1])].add(1.0)
    assert not np.allclose(np.asarray(net.features(states, anchors, pos, mask,
                                                   embedding=moved))[0, -1], base[0, -1])
    with pytest.raises(ConfigError, match="output embedding"):
        net.features(states, anchors, pos, mask)
    run(dataclasses.replace(CFG, steps=4), tmp_path / "t", model=model, progress_bar=False,
        log=lambda m: None, max_steps_now=1)
    with pytest.raises(ConfigError, match="anchor = 'table', this one 'model'"):
        run(cfg, tmp_path / "t", model=model, progress_bar=False, log=lambda m: None)


def test_model_head_scores_the_request_tokens(model, tmp_path):
    """head="model": the drafter trains against the frozen model's output embedding (the loss
    falls); at inference each drafted token is the argmax over the draft vocabulary plus the
    extra tokens, of the same scores a full-vocabulary readout gives them, so tokens outside
    the draft vocabulary (here: the prompt's) are drafted; a "vocab" head ignores them."""
    from lookahead_jax.looped.drafter import output_embedding  # noqa: PLC0415
    cfg = dataclasses.replace(CFG, head="model")
    run(cfg, tmp_path / "m", model=model, progress_bar=False, log=lambda m: None)
    losses = _losses(tmp_path / "m")
    assert losses[8] < losses[1]
    drafter = LadDrafter.load(tmp_path / "m", model.config)
    net = nnx.merge(drafter.graphdef, drafter.params["net"])
    vocab = drafter.params["vocab"]
    assert net.shape.head == "model" and len(vocab) <= 64
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
    the same check refuses a model of another shape; its shape is the preset's (written
    once). (smol_loop and smol_loop_2x4 have one shape: the check cannot tell them apart; the
    drafter file's base_digest can, test_recursive.)"""
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    cfg = lad_config.get(name)
    model = load_preset(cfg.model_preset).model

    def shape(m):
        return m.family, m.hidden_size, m.vocab_size, m.num_loops

    assert (cfg.model_family, cfg.model_hidden, cfg.model_vocab, cfg.model_loops) == shape(model)
    lad_config.check_base_model(cfg, load_preset(cfg.model_preset).model, cfg.model_preset)
    other = next(n for n in sorted(lad_config.CONFIGS)
                 if shape(load_preset(lad_config.get(n).model_preset).model) != shape(model))
    with pytest.raises(ConfigError, match="does not match lad config"):
        other_preset = lad_config.get(other).model_preset
        lad_config.check_base_model(cfg, load_preset(other_preset).model, other_preset)


@pytest.mark.parametrize("layers,head,arch", [(1, "vocab", "heads"), (2, "model", "heads"),
                                              (1, "vocab", "queries"), (2, "model", "queries")])
def test_last_only_features_equal_the_full_pass_at_the_last_position(layers, head, arch):
    """Decoding asks for the last position's drafts only; the shortcut (heads: the last
    layer's queries and MLP for that position alone; queries: that position's K query
    positions alone) gives the full pass's values there, with a window mask that hides some
    positions."""
    shape = DrafterShape(state_size=24, vocab_size=50, hidden_size=32, num_layers=layers,
                         num_heads=2, K=3, draft_vocab=40, head=head, arch=arch)
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


def test_query_drafts_see_their_context_and_earlier_queries_only():
    """Arch "queries": the K drafts of position t, from the whole sequence's training pass,
    equal those of the sequence cut after t (they see no later context, nor another
    position's queries); the k-th draft does not change when a later query's embedding does,
    and does when an earlier one's does."""
    shape = DrafterShape(state_size=24, vocab_size=50, hidden_size=32, num_layers=2,
                         num_heads=2, K=3, draft_vocab=40, arch="queries")
    net = LookaheadDrafter(shape, rngs=nnx.Rngs(2))
    rng = np.random.default_rng(3)
    b, t = 2, 6
    states = jnp.asarray(rng.normal(size=(b, t, 24)), jnp.float32)
    anchors = jnp.asarray(rng.integers(0, 50, (b, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    full = net.features(states, anchors, positions, mask)
    for u in range(1, t + 1):
        cut = net.features(states[:, :u], anchors[:, :u], positions[:, :u], mask[:, :u, :u],
                           last_only=True)
        np.testing.assert_allclose(cut[:, 0], full[:, u - 1], rtol=2e-5, atol=2e-5)
    q = net.query_embed.get_value()
    net.query_embed.set_value(q.at[2].add(1.0))  # the last query's input
    moved = net.features(states, anchors, positions, mask)
    np.testing.assert_allclose(moved[:, :, :2], full[:, :, :2], rtol=2e-5, atol=2e-5)
    assert float(jnp.abs(moved[:, :, 2] - full[:, :, 2]).max()) > 1e-3
    net.query_embed.set_value(q.at[0].add(1.0))  # the first query's input reaches them all
    moved = net.features(states, anchors, positions, mask)
    assert (jnp.abs(moved - full).max(axis=(0, 1, 3)) > 1e-3).all()
