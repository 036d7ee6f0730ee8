"""LoopAhead (greedy): a candidate tree of tokens at different loop depths, drafted early by the
looped model's native proposals and a lookahead drafter (LAD), paused by intermediate-loop
feedback, decided by the full-depth readout alone (`--method=loopahead`, looped models).

Each step is one batched call of the shared block over the scheduled nodes of the tree
(`loop_tree.loop_advance`), then:

1. Verification and commit (possibly several tokens): while the root is at full depth R, its
   argmax is emitted and its K/V committed; the child holding that token becomes the root
   (the other subtrees are pruned), else the emitted token restarts as a fresh root. A drafted
   chain that advanced as one block reaches R together, so a whole accepted chain commits in
   one step.
2. Drafts at depth r1: a node reaching r1 proposes its readout's argmax (the native proposal,
   the anchor). A node with no child yet gets the anchor as a child and, below it, a chain of
   the drafter's K tokens (one drafter call per row and step, over the depth-r1 states and
   native proposals of the last `window` positions: committed tokens and the node's
   ancestors); all of them start at depth 0 and advance together. A node whose children do
   not include its anchor gets the anchor as an extra child.
3. Feedback at depth r2 (scheduling): a node reaching r2 pauses every child whose token
   differs from its depth-r2 argmax, which suspends the child's subtree (K/V kept, not
   advanced), and adds that argmax as a child when none holds it; a paused child resumes
   when it is accepted (it becomes the root).
4. Budget: at most `max_active` nodes advance per step (0: all eligible), nearest positions
   first; a node never runs deeper than its ancestors (suspension covers whole subtrees).

Output equals plain full-depth greedy decoding token for token whatever the drafts. Counts as
LoopSpec: loops (shared-block calls) and candidate advances per output token.
Sampling (accept min(1, p/q) along the tree) is not implemented yet.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from lookahead_jax.generation import Output, run_steps
from lookahead_jax.loop_tree import LoopTree, commit_root, loop_advance, prefill_all_depths
from lookahead_jax.loopspec import LoopStats, check_looped, check_scratch_room, loop_summary
from lookahead_jax.sampling import Sampling
from models.config import ConfigError
from models.kv_cache import KVCache


class LadDrafter:
    """A trained lookahead drafter (`train_lad`) ready for decoding: its graph, parameters and
    draft vocabulary. Hashed by identity (a static part of the method; the parameters travel
    as arrays through `LoopAhead.bundle_params`)."""

    def __init__(self, model, draft_vocab: np.ndarray):
        self.graphdef, params = nnx.split(model)
        self.params = {"net": params, "vocab": jnp.asarray(draft_vocab, jnp.int32)}
        self.K = model.shape.K

    def draft(self, params, states, anchors, positions, mask) -> jax.Array:
        """states [B,W,E], anchors, positions [B,W], mask [B,W,W] -> the K tokens after the
        anchor of the last window position, [B,K] (full-vocabulary ids)."""
        net = nnx.merge(self.graphdef, params["net"])
        logits = net(states, anchors, positions, mask)[:, -1]  # [B,K,Vd]
        return params["vocab"][jnp.argmax(logits, axis=-1)]

    @classmethod
    def load(cls, workdir, model_config=None) -> "LadDrafter":
        """The drafter chosen by a `train_lad` run in `workdir` (its `lad_config.json`); with
        model_config, checks that the looped model it drafts for has the drafter's shape."""
        import json  # noqa: PLC0415
        import os  # noqa: PLC0415

        from train_lad.config import LadConfig, check_base_model  # noqa: PLC0415
        from train_lad.train import load_drafter  # noqa: PLC0415
        path = os.path.join(os.fspath(workdir), "lad_config.json")
        if not os.path.exists(path):
            raise ConfigError(f"drafter {workdir}: no lad_config.json (train one with "
                              f"python -m train_lad.main)")
        with open(path) as f:
            fields = {k: v for k, v in json.load(f).items() if k != "base"}
        cfg = LadConfig(**fields)
        if model_config is not None:
            check_base_model(cfg, model_config, "the decoding model")
        model, vocab = load_drafter(workdir, cfg)
        return cls(model, vocab)


@struct.dataclass
class LoopAheadState:
    cache: KVCache
    out: Output
    tree: LoopTree
    paused: jax.Array  # [B, C] bool: the node conflicted with its parent's feedback readout
    h1: jax.Array  # [B, C, E] each node's state at depth r1 (once reached)
    native: jax.Array  # [B, C] int32 each node's native proposal (argmax at r1)
    ctx_h1: jax.Array  # [B, S, E] the committed tokens' depth-r1 states
    ctx_native: jax.Array  # [B, S] int32 the committed tokens' native proposals
    key: jax.Array
    steps: jax.Array
    stats: LoopStats


@dataclasses.dataclass(frozen=True)
class LoopAhead:
    """LoopAhead decoding (greedy). r1: draft depth (native proposals and LAD); r2: feedback
    depth (0: off); drafter: a `LadDrafter` (None: native proposals only, the "drafter off"
    ablation); scheduling: feedback suspension on/off; max_active: nodes advanced per step
    (0: all); window: the drafter's context positions; capacity: tree nodes (0: automatic)."""

    sampling: Sampling = Sampling()
    r1: int = 1
    r2: int = 2
    drafter: Any = None
    scheduling: bool = True
    max_active: int = 0
    window: int = 32
    capacity: int = 0

    def __post_init__(self):
        if not self.sampling.greedy:
            raise ConfigError("loopahead: sampling is not implemented yet (greedy only)")
        if self.r1 < 1 or (self.r2 and self.r2 <= self.r1):
            raise ConfigError(f"loopahead: need 1 <= r1 < r2 (or r2 = 0), got {self.r1}, "
                              f"{self.r2}")

    @property
    def K(self) -> int:
        return self.drafter.K if self.drafter is not None else 0

    def tree_capacity(self, num_loops: int) -> int:
        return self.capacity or (self.K + 2) * 2 + num_loops // self.r1 + 2

    @property
    def step_tokens(self) -> int:
        return self.capacity or 48

    def bundle_params(self, params):
        return {"model": params, "drafter": self.drafter.params if self.drafter else {}}

    def init(self, graphdef, params, tokens, lengths, cache, key, *, max_new_tokens, eos_ids,
             vocab_size):
        model = nnx.merge(graphdef, params["model"])
        check_looped(model)
        cfg = model.config
        if max(self.r1, self.r2) >= cfg.num_loops:
            raise ConfigError(f"loopahead: r1 ({self.r1}) and r2 ({self.r2}) must be below the "
                              f"model's {cfg.num_loops} loops")
        capacity = self.tree_capacity(cfg.num_loops)
        check_scratch_room(cache, tokens.shape[1], max_new_tokens, capacity)
        logits, cache, h1, nat = prefill_all_depths(
            model, tokens, lengths, cache, (self.r1, self.r2, cfg.num_loops), keep_depth=self.r1)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        b, p = tokens.shape
        out, _ = Output.init(b, max_new_tokens).emit(first[:, None], jnp.ones_like(lengths),
                                                     eos_ids)
        tree = LoopTree.init(first, lengths.astype(jnp.int32), capacity, cfg.hidden_size,
                             model.dtype, 1)
        s = cache.max_len
        ctx_h1 = jnp.zeros((b, s, cfg.hidden_size), h1.dtype).at[:, :p].set(h1)
        ctx_nat = jnp.zeros((b, s), jnp.int32).at[:, :p].set(nat)
        return LoopAheadState(cache, out, tree, jnp.zeros((b, capacity), bool),
                              jnp.zeros((b, capacity, cfg.hidden_size), h1.dtype),
                              jnp.zeros((b, capacity), jnp.int32), ctx_h1, ctx_nat, key,
                              jnp.ones((), jnp.int32), LoopStats.zeros(b))

    def run(self, graphdef, params, state, max_steps, *, eos_ids):
        model = nnx.merge(graphdef, params["model"])
        return run_steps(lambda s: self.step(model, params["drafter"], s, eos_ids), state,
                         max_steps)

    def summary(self, state: LoopAheadState) -> dict:
        return {"r1": self.r1, "r2": self.r2, "K": self.K, "scheduling": self.scheduling,
                "capacity": state.tree.capacity, **loop_summary(state.stats)}

    # -- one step ---------------------------------------------------------------------------
    def step(self, model, drafter_params, state: LoopAheadState, eos_ids) -> LoopAheadState:
        r_full = model.config.num_loops
        live = ~state.out.done
        tree = state.tree
        b, c = tree.valid.shape
        rows = jnp.arange(b)
        slots = jnp.arange(c)

        # schedule: valid, not suspended (paused itself or below a paused node), below R;
        # nearest positions first within the budget
        suspended = state.paused | (tree.anc & state.paused[:, None, :]).any(-1)
        run = tree.valid & ~suspended & (tree.depth < r_full) & live[:, None]
        if self.max_active:
            before = (run[:, None, :] & ((tree.pos[:, None, :] < tree.pos[:, :, None])
                                         | ((tree.pos[:, None, :] == tree.pos[:, :, None])
                                            & (slots[None, None, :] < slots[None, :, None]))))
            run = run & (before.sum(-1) < self.max_active)
        depths = (self.r1, self.r2, r_full)
        tree, cache, logits, active = loop_advance(model, tree, state.cache, live, depths, run)
        top = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, C] at each node's depth
        at_r1 = active & (tree.depth == self.r1)
        h1 = jnp.where(at_r1[..., None], tree.h, state.h1)
        native = jnp.where(at_r1, top, state.native)
        paused = state.paused
        ctx_h1, ctx_nat = state.ctx_h1, state.ctx_native

        # 1. verify and commit while the root is at full depth
        out = state.out
        verified = jnp.zeros((b,), jnp.int32)
        accepted = jnp.zeros((b,), jnp.int32)
        going = live
        for _ in range(self.K + 2):
            root = tree.root
            at_r = going & tree.valid[rows, root] & (tree.depth[rows, root] == r_full)
            nxt = top[rows, root]
            cache_pos = cache.length
            ctx_h1 = ctx_h1.at[rows, jnp.where(at_r, cache_pos, ctx_h1.shape[1])].set(
                h1[rows, root], mode="drop")
            ctx_nat = ctx_nat.at[rows, jnp.where(at_r, cache_pos, ctx_nat.shape[1])].set(
                native[rows, root], mode="drop")
            cache = commit_root(cache, tree, at_r)
            out, _ = out.emit(nxt[:, None], at_r.astype(jnp.int32), eos_ids)
            match = tree.valid & (tree.parent == root[:, None]) & (tree.token == nxt[:, None])
            keep = at_r & match.any(1)
            child = jnp.argmax(match, axis=1).astype(jnp.int32)
            root_pos = tree.pos[rows, root]
            tree = tree.keep_subtree(keep, child)
            restart = at_r & ~keep
            tree = tree.restart(restart, nxt, root_pos + 1)
            paused = jnp.where(restart[:, None], False, paused)  # a kept root resumes
            paused = paused & tree.valid & (slots[None] != tree.root[:, None])
            verified += at_r.astype(jnp.int32)
            accepted += keep.astype(jnp.int32)
            going = keep & ~out.done
        at_r1 = at_r1 & tree.valid & ~tree.fresh

        # 3. feedback at r2: children that disagree with their parent's depth-r2 argmax pause
        #    (with their subtrees); the r2 proposal joins as a child when no child holds it
        q = jnp.zeros((b, c, 1), jnp.float32)
        if self.r2 and self.scheduling:
            at_r2 = active & tree.valid & ~tree.fresh & (tree.depth == self.r2)
            par = jnp.maximum(tree.parent, 0)
            conflict = (tree.valid & (tree.parent >= 0) & at_r2[rows[:, None], par]
                        & (tree.token != top[rows[:, None], par]))
            paused = paused | conflict
            kids = tree.valid[:, None, :] & (tree.parent[:, None, :] == slots[None, :, None])
            has_fb = (kids & (tree.token[:, None, :] == top[:, :, None])).any(-1)
            tree, _ = tree.spawn(at_r2 & kids.any(-1) & ~has_fb, top, q, 2)

        # 2. drafts at r1: the anchor (native proposal), and the drafter's chain below it
        kids = tree.valid[:, None, :] & (tree.parent[:, None, :] == slots[None, :, None])
        has_kid = kids.any(-1)
        has_anchor = (kids & (tree.token[:, None, :] == native[:, :, None])).any(-1)
        want_anchor = at_r1 & ~has_anchor
        if self.drafter is None:
            tree, _ = tree.spawn(want_anchor, native, q, 1)
        else:
            lad_node = jnp.argmax(at_r1 & ~has_kid, axis=1).astype(jnp.int32)  # [B]
            use_lad = (at_r1 & ~has_kid).any(1)
            lad = jax.lax.cond(  # the drafter runs only in steps where a row needs it
                use_lad.any(),
                lambda: self._draft(drafter_params, tree, cache, h1, native, ctx_h1, ctx_nat,
                                    lad_node),
                lambda: jnp.zeros((b, self.K), jnp.int32))  # [B, K]
            tree, child = tree.spawn(want_anchor, native, q, 1)
            last = jnp.where(use_lad, child[rows, lad_node], -1)
            for k in range(self.K):
                want = (slots[None] == last[:, None]) & (last >= 0)[:, None]
                tree, child = tree.spawn(want, jnp.broadcast_to(lad[:, k:k + 1], (b, c)), q, 3)
                last = jnp.where(last >= 0, child[rows, jnp.maximum(last, 0)], -1)

        live_i = live.astype(jnp.int32)
        st = state.stats
        stats = LoopStats(st.loops + live_i, st.advances + active.sum(1, dtype=jnp.int32),
                          st.verified + verified, st.accepted + accepted, st.accepted_second)
        return LoopAheadState(cache, out, tree, paused & tree.valid, h1, native, ctx_h1,
                              ctx_nat, state.key, state.steps + 1, stats)

    def _draft(self, params, tree: LoopTree, cache: KVCache, h1, native, ctx_h1, ctx_nat,
               node: jax.Array) -> jax.Array:
        """The drafter's K tokens for node [B] over the window of positions ending at it."""
        b, c = tree.valid.shape
        rows = jnp.arange(b)
        w = self.window
        pos_i = tree.pos[rows, node]  # [B]
        want = pos_i[:, None] - w + 1 + jnp.arange(w)[None]  # [B, W]
        committed = (want >= 0) & (want < cache.length[:, None])
        mine = tree.anc[rows, node] | (jnp.arange(c)[None] == node[:, None])  # [B, C]
        sel = mine[:, None, :] & (tree.pos[:, None, :] == want[:, :, None])  # [B, W, C]
        in_tree = sel.any(-1)
        j = jnp.argmax(sel, axis=-1)  # [B, W]
        safe = jnp.clip(want, 0, ctx_h1.shape[1] - 1)
        states = jnp.where(committed[..., None], ctx_h1[rows[:, None], safe],
                           h1[rows[:, None], j])
        anchors = jnp.where(committed, ctx_nat[rows[:, None], safe], native[rows[:, None], j])
        ok = committed | in_tree
        mask = jnp.tril(jnp.ones((w, w), bool))[None] & ok[:, None, :] & ok[:, :, None]
        mask = mask | jnp.eye(w, dtype=bool)[None]
        return self.drafter.draft(params, states.astype(jnp.float32), anchors,
                                  jnp.maximum(want, 0), mask)
