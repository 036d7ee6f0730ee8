"""Training the lookahead drafter with Optax on frozen early-loop states.

The looped model is frozen: it only produced the data (`train_lad.data`); the optimizer holds
the drafter's parameters alone. Targets at position t (in the continuation): the teacher's
tokens t + 2 .. t + K + 1 in the draft vocabulary, counted only where the anchor (the native
proposal for t + 1) is right and the target is in the draft vocabulary.

Checkpoint selection: every `eval_every` steps the development split's average accepted
prefix length (anchor included: 0 when the anchor is wrong, else 1 + the drafted tokens that
match the teacher before the first miss) is measured; the best is kept in `<workdir>/best`,
the latest in `<workdir>/latest` (Orbax), so a stopped run resumes from its last checkpoint.

A residual head (`LadConfig.residual`, Raven's R4-adapted head): the network is the backbone
drafter (`LadConfig.backbone`, trained on an earlier loop's states) plus the head; only the
head's parameters are trained (the optimizer and the checkpoints hold them alone), on the
states of `draft_depth`, and the backbone's draft vocabulary is kept. The development split's
accepted prefix before the first step (the backbone alone on these states) is recorded as
`backbone_dev_accepted_prefix`.
When training is complete (at the end of the run, or when a finished run is resumed) the best
checkpoint is written as `<workdir>/drafter.safetensors` (`save_drafter_file`), the file
decoding loads. A metrics log (`metrics.jsonl`) and a progress bar report training.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from models.config import ConfigError
from models.layers import causal_mask
from train_lad.config import LadConfig
from lookahead_jax.looped.drafter import (DRAFTER_FILE, DrafterShape, LookaheadDrafter,
                                          save_drafter_file)


def drafter_shape(cfg: LadConfig, draft_vocab: int) -> DrafterShape:
    return DrafterShape(state_size=cfg.model_hidden, vocab_size=cfg.model_vocab,
                        hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                        num_heads=cfg.num_heads, K=cfg.K, draft_vocab=draft_vocab,
                        head=cfg.head, arch=cfg.arch, anchor=cfg.anchor, residual=cfg.residual)


def is_residual_head(path, _value) -> bool:
    """nnx filter: the residual head's parameters (what a residual-head run trains)."""
    return str(path[0]).startswith("residual_")


def check_backbone(cfg: LadConfig, backbone) -> None:
    """Refuses a backbone (a loaded `LadDrafter`) whose network is not cfg's drafter without
    its residual head, or that has a residual head itself."""
    net = nnx.merge(backbone.graphdef, backbone.params["net"]).shape
    if net.residual:
        raise ConfigError(f"lad config {cfg.name}: the backbone has a residual head itself")
    want = dataclasses.replace(drafter_shape(cfg, net.draft_vocab), residual=0)
    for f in dataclasses.fields(DrafterShape):
        if getattr(net, f.name) != getattr(want, f.name):
            raise ConfigError(f"lad config {cfg.name}: the backbone's {f.name} is "
                              f"{getattr(net, f.name)!r}, the config's {getattr(want, f.name)!r}")


def targets(tokens: jax.Array, native: jax.Array, table: jax.Array, prompt_len: int, K: int
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens, native [B,T] -> (draft-vocab targets [B,T,K], target valid [B,T,K],
    anchor right [B,T]): position t's k-th target is token t + 1 + k (k = 1..K); positions
    from the last prompt token to T - 2 count."""
    b, t = tokens.shape
    idx = jnp.arange(t)[:, None] + 1 + jnp.arange(1, K + 1)[None, :]  # [T,K]
    inside = idx < t
    tgt = table[tokens[:, jnp.minimum(idx, t - 1)]]  # [B,T,K]
    pos = jnp.arange(t)
    counted = (pos >= prompt_len - 1) & (pos <= t - 2)
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    anchor_ok = (native == nxt) & counted[None]
    valid = inside[None] & (tgt >= 0) & anchor_ok[..., None]
    return jnp.maximum(tgt, 0), valid, anchor_ok


def forward(model: LookaheadDrafter, batch: dict, out_emb: jax.Array | None,
            emb: jax.Array | None = None) -> jax.Array:
    """out_emb [E_model, Vd]: head "model"'s output-embedding columns (None for "vocab");
    emb [E_model, V]: the whole output embedding, for anchor "model" (None for "table")."""
    states = batch["states"].astype(jnp.float32)
    b, t = batch["tokens"].shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = causal_mask(jnp.full((b,), t, jnp.int32), t)
    return model(states, batch["native"], pos, mask, out_emb, emb)


def accepted_prefix(logits, tgt, valid, anchor_ok, counted_len):
    """Per counted position: 0 if the anchor is wrong, else 1 + the leading drafted tokens
    equal to the teacher's. Returns the sum over positions [] and the position count []."""
    hit = (jnp.argmax(logits, -1) == tgt) & valid
    run = jnp.cumprod(hit, axis=-1).sum(-1)
    return (anchor_ok * (1 + run)).sum(), counted_len


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "prompt_len", "K"))
def train_step(params, frozen, opt_state, batch, table, out_emb, emb, *, graphdef, tx,
               prompt_len, K):
    """One update of the trained parameters `params` (frozen: the rest, not updated)."""
    def loss_fn(p):
        logits = forward(nnx.merge(graphdef, p, frozen), batch, out_emb, emb)
        tgt, valid, _ = targets(batch["tokens"], batch["native"], table, prompt_len, K)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt)
        return (ce * valid).sum() / jnp.maximum(valid.sum(), 1)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@functools.partial(jax.jit, static_argnames=("graphdef", "prompt_len", "K"))
def eval_step(params, frozen, batch, table, out_emb, emb, *, graphdef, prompt_len, K):
    logits = forward(nnx.merge(graphdef, params, frozen), batch, out_emb, emb)
    tgt, valid, anchor_ok = targets(batch["tokens"], batch["native"], table, prompt_len, K)
    b, t = batch["tokens"].shape
    pos = jnp.arange(t)
    n = ((pos >= prompt_len - 1) & (pos <= t - 2)).sum() * b
    return accepted_prefix(logits, tgt, valid, anchor_ok, n)


def evaluate(params, graphdef, data: dict, table, cfg: LadConfig, batch_size: int = 32,
             out_emb: jax.Array | None = None, emb: jax.Array | None = None,
             frozen=None) -> float:
    """Average accepted prefix length (anchor included) over a split (frozen: the parameters
    not trained, when `params` are only some of them)."""
    if frozen is None:
        frozen = nnx.State({})
    total = count = 0.0
    for i in range(0, len(data["tokens"]), batch_size):
        batch = {k: jnp.asarray(v[i:i + batch_size]) for k, v in data.items()}
        s, n = eval_step(params, frozen, batch, table, out_emb, emb, graphdef=graphdef,
                         prompt_len=cfg.prompt_len, K=cfg.K)
        total += float(s)
        count += float(n)
    return total / max(count, 1.0)


def make_tx(cfg: LadConfig) -> optax.GradientTransformation:
    warmup = min(cfg.warmup, cfg.steps // 4)
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, cfg.steps, cfg.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))


@dataclasses.dataclass
class Progress:
    step: int = 0
    best_dev: float = -1.0
    best_step: int = -1


class Checkpoints:
    """Orbax managers: `latest` (resume) and `best` (the selected drafter)."""

    def __init__(self, workdir: pathlib.Path):
        opts = ocp.CheckpointManagerOptions(max_to_keep=1, create=True)
        self.latest = ocp.CheckpointManager((workdir / "latest").absolute(), options=opts)
        self.best = ocp.CheckpointManager((workdir / "best").absolute(), options=opts)

    @staticmethod
    def _save(manager, step, params, opt_state, meta):
        items = {"params": params} if opt_state is None else {"params": params,
                                                             "opt_state": opt_state}
        manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(items), meta=ocp.args.JsonSave(meta)))
        manager.wait_until_finished()

    def save_latest(self, params, opt_state, meta):
        self._save(self.latest, meta["step"], params, opt_state, meta)

    def save_best(self, params, meta):
        self._save(self.best, meta["step"], params, None, meta)

    @staticmethod
    def restore(manager, template: dict) -> tuple[dict, dict] | None:
        step = manager.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        got = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return got.state, got.meta

    def close(self):
        self.latest.close()
        self.best.close()


def check_workdir(workdir, base_fingerprint: dict) -> None:
    """Refuses a workdir whose checkpoints were trained on another looped model."""
    directory = (pathlib.Path(workdir) / "latest").absolute()
    if not directory.exists():
        return
    mgr = ocp.CheckpointManager(directory)
    try:
        step = mgr.latest_step()
        if step is None:
            return
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    finally:
        mgr.close()
    if meta.get("base") != base_fingerprint:
        raise ConfigError(f"{workdir}: its checkpoints were trained on another looped model "
                          f"({meta.get('base')}), not {base_fingerprint}; use a fresh workdir")


def train(cfg: LadConfig, data: dict[str, dict], draft_vocab: np.ndarray, workdir, *,
          base_fingerprint: dict, log=print, progress_bar: bool = True,
          max_steps_now: int | None = None, out_embedding: np.ndarray | None = None,
          export_dtype: str | None = None, backbone=None,
          base_digest: str | None = None) -> dict:
    """Trains (or resumes) a drafter on `data` (split -> tokens/states/native arrays).

    base_fingerprint: what identifies the frozen model (its config and a weights digest);
    a workdir made with another model is refused. max_steps_now: stop after this many steps
    of this call (saving a checkpoint, as Ctrl-C does); the next call resumes.
    out_embedding [E_model, V]: the frozen model's output embedding (head or anchor "model"
    only).
    Once all cfg.steps are done, writes the best checkpoint's drafter to
    `<workdir>/drafter.safetensors` (its parameters in export_dtype, e.g. "float16", when
    given: the confirmation split is then scored with the parameters rounded to it, as
    decoding will load them). backbone: a loaded `LadDrafter` whose network is frozen
    under a residual head (cfg.residual > 0; its draft vocabulary replaces draft_vocab).
    base_digest: the frozen model's `params_digest`, recorded in the drafter file.
    Returns a summary dict."""
    if bool(cfg.residual) != (backbone is not None):
        raise ConfigError(f"lad config {cfg.name}: a residual head is trained over a backbone "
                          f"drafter, and only then is one given")
    if backbone is not None:
        check_backbone(cfg, backbone)
        draft_vocab = np.asarray(backbone.params["vocab"])
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    table = jnp.asarray(_table(draft_vocab, cfg.model_vocab))
    shape = drafter_shape(cfg, len(draft_vocab))
    out_emb = emb = None
    if shape.needs_embedding:
        if out_embedding is None:
            raise ConfigError(f"lad config {cfg.name}: head or anchor 'model' needs the looped "
                              f"model's output embedding")
        emb = jnp.asarray(np.asarray(out_embedding, np.float32))
        out_emb = emb[:, draft_vocab] if cfg.head == "model" else None
        emb = emb if cfg.anchor == "model" else None
    model = LookaheadDrafter(shape, rngs=nnx.Rngs(cfg.seed))
    if backbone is not None:  # its network, frozen; the residual head alone is trained
        nnx.update(model, backbone.params["net"])
        graphdef, params, frozen = nnx.split(model, is_residual_head, ...)
    else:
        graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    tx = make_tx(cfg)
    opt_state = tx.init(params)
    check_workdir(workdir, base_fingerprint)
    ckpt = Checkpoints(workdir)
    prog = Progress()
    got = Checkpoints.restore(ckpt.latest, {"params": params, "opt_state": opt_state})
    if got is not None:
        state, meta = got
        params, opt_state = state["params"], state["opt_state"]
        prog = Progress(int(meta["step"]), float(meta["best_dev"]), int(meta["best_step"]))
        log(f"resumed from step {prog.step} (best dev accepted prefix {prog.best_dev:.3f} at "
            f"step {prog.best_step})")
    train_d = data["train"]
    n = len(train_d["tokens"])
    metrics_path = workdir / "metrics.jsonl"
    bar = None
    if progress_bar:
        from tqdm import tqdm  # noqa: PLC0415
        bar = tqdm(total=cfg.steps, initial=prog.step, desc=f"lad {cfg.name}", unit="step")
    t0 = time.perf_counter()
    start = prog.step
    backbone_dev = None
    if backbone is not None:  # the ablation: the frozen backbone alone on these states
        backbone_dev = evaluate(jax.tree.map(jnp.zeros_like, params), graphdef, data["dev"],
                                table, cfg, out_emb=out_emb, emb=emb, frozen=frozen)

    def save_latest():
        ckpt.save_latest(params, opt_state, {"step": prog.step, "base": base_fingerprint,
                                             "best_dev": prog.best_dev,
                                             "best_step": prog.best_step})

    try:
        while prog.step < cfg.steps:
            if max_steps_now is not None and prog.step - start >= max_steps_now:
                save_latest()
                break
            rng = np.random.default_rng([cfg.seed, prog.step])
            idx = rng.choice(n, size=min(cfg.batch_size, n), replace=False)
            batch = {k: jnp.asarray(v[idx]) for k, v in train_d.items()}
            params, opt_state, loss = train_step(params, frozen, opt_state, batch, table,
                                                 out_emb, emb, graphdef=graphdef, tx=tx,
                                                 prompt_len=cfg.prompt_len, K=cfg.K)
            prog.step += 1
            record: dict[str, Any] = {"step": prog.step, "loss": float(loss),
                                      "elapsed_s": time.perf_counter() - t0}
            if prog.step % cfg.eval_every == 0 or prog.step == cfg.steps:
                dev = evaluate(params, graphdef, data["dev"], table, cfg, out_emb=out_emb,
                               emb=emb, frozen=frozen)
                record["dev_accepted_prefix"] = dev
                meta = {"step": prog.step, "base": base_fingerprint}
                if dev > prog.best_dev:
                    prog.best_dev, prog.best_step = dev, prog.step
                    ckpt.save_best(params, {**meta, "dev_accepted_prefix": dev})
                save_latest()
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {record['loss']:.3f} best dev {prog.best_dev:.3f}")
    except KeyboardInterrupt:
        save_latest()
        ckpt.close()
        log(f"stopped at step {prog.step}; run again to resume")
        raise
    finally:
        if bar is not None:
            bar.close()
    best = Checkpoints.restore(ckpt.best, {"params": params})
    ckpt.close()
    best_params = best[0]["params"] if best else params
    if export_dtype is not None:
        best_params, frozen = jax.tree.map(lambda x: x.astype(export_dtype).astype(x.dtype),
                                           (best_params, frozen))
    summary = {"step": prog.step, "best_step": prog.best_step, "dev_accepted_prefix": prog.best_dev}
    if backbone is not None:
        summary["backbone_depth"] = backbone.draft_depth
        summary["backbone_dev_accepted_prefix"] = backbone_dev
    if prog.step >= cfg.steps:
        drafter = workdir / DRAFTER_FILE
        save_drafter_file(drafter, nnx.merge(graphdef, best_params, frozen), draft_vocab,
                          draft_depth=cfg.draft_depth, model_family=cfg.model_family,
                          model_loops=cfg.model_loops, dtype=export_dtype,
                          backbone_depth=None if backbone is None else backbone.draft_depth,
                          base_digest=base_digest)
        summary["export_dtype"] = export_dtype or "float32"
        log(f"drafter (step {prog.best_step}): {drafter}")
    if "confirm" in data and len(data["confirm"]["tokens"]):
        summary["confirm_accepted_prefix"] = evaluate(best_params, graphdef, data["confirm"],
                                                      table, cfg, out_emb=out_emb, emb=emb,
                                                      frozen=frozen)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _table(draft_vocab: np.ndarray, vocab: int) -> np.ndarray:
    from train_lad.data import to_draft_ids  # noqa: PLC0415
    return to_draft_ids(draft_vocab, vocab)

