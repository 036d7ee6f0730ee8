"""Calibrate a drafter for sampling: how often each drafted token is accepted, by its place in
the chain and the drafter's confidence, at a few temperatures (`drafter.Calibration`).

    python -m train_lad.calibrate --config=tiny_ouro --lad=checkpoints/tiny_ouro_lad
        [--temperatures=0.5,0.7,1.0] [--bins=10]

`train_lad.main` calibrates every drafter it writes; this command adds a calibration to a
drafter file written without one (it rewrites the file, nothing else in it changes).

The data: the development split of the drafter's config (the same prompts `train_lad.main`
draws, the frozen model's full-depth greedy continuations and its states at the draft depth),
and the full-depth readout's logits at every position. At each position t of a continuation
whose native proposal (the anchor) is the next token, the drafter drafts K tokens with
confidences c_k (the softmax probability of each argmax). When decoding samples at
temperature T, speculative sampling accepts a drafted token x (a deterministic proposal) with
probability p_T(x), the full-depth target at T given what precedes it; that is measured here
as p_T(d_k) at position t + k given the continuation's own tokens, for the k whose earlier
drafts d_1 .. d_{k-1} equal the continuation (so the prefix is the chain's). Per temperature,
k and confidence bin (`bins` equal bins of [0, 1]), the table holds the mean of p_T(d_k),
shrunk towards that k's mean over all bins by `PRIOR` pseudo-samples (an empty bin gets the
k's mean). Approximations: the anchor is the greedy native proposal (when sampling it is
drawn), the continuation greedy, the drafter's candidates its draft vocabulary alone
(decoding adds the request's tokens), and temperature alone warps p (no top-k / top-p).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from lookahead_jax.looped.drafter import (Calibration, LadDrafter, add_calibration,
                                          output_embedding)
from models.config import ConfigError
from train_lad.cli import define_drafter_flags, drafter_file
from train_lad.data import depth_readout
from train_lad.train import forward

PRIOR = 5.0  # pseudo-samples of a k's overall mean in every bin
TEMPERATURES = (0.5, 0.7, 1.0)
BINS = 10

FLAGS = flags.FLAGS


def full_depth_logits(model, tokens: np.ndarray, batch_size: int = 16) -> np.ndarray:
    """The full-depth readout's logits [N, T, V] float32 of each row of tokens [N, T]."""
    graphdef, params = nnx.split(model)
    r_full = model.config.num_loops
    one = jax.jit(lambda p, t: depth_readout(nnx.merge(graphdef, p), t, r_full)[1].astype(
        jnp.float32))
    return np.concatenate([np.asarray(one(params, jnp.asarray(tokens[i:i + batch_size])))
                           for i in range(0, len(tokens), batch_size)])


def drafts_with_confidence(drafter: LadDrafter, data: dict, embedding) -> tuple:
    """Every position's K drafts [N, T, K] (full-vocabulary ids) and their confidences
    [N, T, K], from the drafter's full causal pass over each row's states and anchors (as
    training scores it, `train_lad.train.forward`)."""
    net = nnx.merge(drafter.graphdef, drafter.params["net"])
    vocab = drafter.params["vocab"]
    emb = None if embedding is None else jnp.asarray(embedding, jnp.float32)
    batch = {k: jnp.asarray(data[k]) for k in ("tokens", "states", "native")}
    logits = forward(net, batch, None if drafter.head == "vocab" else emb[:, vocab],
                     emb if net.shape.anchor == "model" else None)
    return (np.asarray(vocab[jnp.argmax(logits, -1)]),
            np.asarray(jax.nn.softmax(logits, -1).max(-1)))


def calibrate(drafted: np.ndarray, confidence: np.ndarray, tokens: np.ndarray,
              native: np.ndarray, logits: np.ndarray, prompt_len: int,
              temperatures=TEMPERATURES, bins: int = BINS) -> tuple[Calibration, dict]:
    """The `Calibration` of drafts [N, T, K] with confidences [N, T, K] against the rows'
    tokens [N, T], native proposals [N, T] and full-depth logits [N, T, V] (the module
    docstring), and per temperature and k the sample count and mean match probability."""
    n, t, k_max = drafted.shape
    table = np.zeros((len(temperatures), k_max, bins), np.float32)
    counts = np.zeros((k_max,), np.int64)
    means = np.zeros((len(temperatures), k_max))
    rows, cols = np.meshgrid(np.arange(n), np.arange(t), indexing="ij")
    # per k, the counted drafts (anchor and earlier drafts equal to the continuation, the
    # drafted token inside the row), the readout position that scores them, their bins
    prefix_ok = ((cols >= prompt_len - 1) & (cols <= t - 2)
                 & (native == np.concatenate([tokens[:, 1:], tokens[:, -1:]], 1)))
    counted = []
    for k in range(1, k_max + 1):
        at = cols + k  # the position whose readout predicts the k-th drafted token
        ok = prefix_ok & (at + 1 <= t - 1)
        d = drafted[..., k - 1]
        b = np.clip(np.floor(confidence[..., k - 1][ok] * bins).astype(int), 0, bins - 1)
        counted.append((ok, np.minimum(at, t - 1), d, b))
        counts[k - 1] = int(ok.sum())
        # the next k needs this draft to equal the continuation's token
        prefix_ok = prefix_ok & (d == tokens[rows, np.minimum(cols + 1 + k, t - 1)])
    for ti, temp in enumerate(temperatures):
        z = logits / temp
        logp = z - z.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        for k, (ok, at, d, b) in enumerate(counted):
            m = np.exp(logp[rows, at, d])[ok]
            mean = float(m.mean()) if len(m) else 0.0
            s = np.bincount(b, weights=m, minlength=bins)
            cnt = np.bincount(b, minlength=bins)
            table[ti, k] = (s + PRIOR * mean) / (cnt + PRIOR)
            means[ti, k] = mean
    cal = Calibration(np.asarray(temperatures, np.float32), np.clip(table, 0.0, 1.0))
    return cal, {"samples_per_k": counts.tolist(),
                 "mean_match": {f"{tt:g}": means[i].round(4).tolist()
                                for i, tt in enumerate(temperatures)}}


def calibrate_drafter(cfg, model, drafter: LadDrafter, dev: dict, temperatures=TEMPERATURES,
                      bins: int = BINS) -> tuple[Calibration, dict]:
    """A drafter's calibration on a split's teacher data `dev` (tokens, states, native)."""
    emb = output_embedding(model) if nnx.merge(drafter.graphdef, drafter.params["net"]
                                               ).shape.needs_embedding else None
    drafted, conf = drafts_with_confidence(drafter, dev, emb)
    logits = full_depth_logits(model, dev["tokens"])
    return calibrate(drafted, conf, dev["tokens"], dev["native"], logits, cfg.prompt_len,
                     temperatures, bins)


def define_flags() -> None:
    if not define_drafter_flags():
        return
    flags.DEFINE_list("temperatures", [f"{t:g}" for t in TEMPERATURES], "Temperatures.")
    flags.DEFINE_integer("bins", BINS, "Confidence bins.")


def main(argv) -> int:
    del argv
    import json  # noqa: PLC0415

    from train_lad import config as lad_config  # noqa: PLC0415
    from train_lad.data import dev_split, load_base_model  # noqa: PLC0415
    try:
        path = drafter_file(FLAGS.lad)
        cfg = lad_config.get(FLAGS.config)
        model, tokenizer = load_base_model(cfg, FLAGS.ckpt)
        drafter = LadDrafter.load(FLAGS.lad, model.config)
        if drafter.draft_depth != cfg.draft_depth:
            raise ConfigError(f"the drafter drafts at depth {drafter.draft_depth}, lad config "
                              f"{cfg.name} at {cfg.draft_depth}")
        temps = [float(t) for t in FLAGS.temperatures]
        cal, info = calibrate_drafter(cfg, model, drafter, dev_split(cfg, model, tokenizer),
                                      temps, FLAGS.bins)
    except (ConfigError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    add_calibration(path, cal)
    print(json.dumps(info))
    print(f"calibrated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
