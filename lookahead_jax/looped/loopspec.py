"""LoopSpec: training-free pipelined speculation for looped models (`--method=loopspec`).

A looped model's readout after d1 < R loops already guesses the next token. LoopSpec drafts
that guess the moment a token reaches depth d1 and starts the drafted child at depth 0 at
once, so the child's early loops run while its parent's later loops run, in the same batched
call of the shared block. When the parent reaches full depth R its readout verifies the child:

- greedy: the child survives when it equals the full-depth argmax;
- sampling: the child x ~ q1 (the warped depth-d1 distribution) is accepted with probability
  min(1, p(x) / q1(x)), p the warped full-depth distribution; on rejection the token is drawn
  from normalize(max(p - q1, 0)). This keeps p exactly (standard speculative sampling).

Optional dual proposal (d2 > d1): when the token reaches depth d2 its readout may propose a
second child, a sibling of the first: greedy, the depth-d2 argmax when it differs from the
first draft; sampling, x2 ~ q2 = normalize(max(p_d2 - q1, 0)), made only when
p_d2(x1) < q1(x1). The full-depth readout verifies the children in cascade: x1 as above; when
rejected, x2 against the residual r1 = normalize(max(p - q1, 0)) with min(1, r1(x2)/q2(x2));
when rejected too, the token is drawn from normalize(max(r1 - q2, 0)).

Either way the full-depth token is emitted and the parent's K/V is committed; the accepted
child's subtree is kept, all others are pruned; with none accepted, the emitted token restarts
at depth 0. Output equals plain full-depth decoding (greedy: token for token; sampling: in
distribution).

Every step is one call of the shared block over the whole tree (`LoopTree`, capacity
R // d1 + 1, enough for the longest chain; twice that with d2), one readout, and the
bookkeeping; the generation after the prefill is one `lax.while_loop`. Counted per row:
loops (shared-block calls while the row is live) and candidate advances (node-loops); plain
decoding spends R of each per token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from lookahead_jax.generation import Output
from lookahead_jax.method import First
from lookahead_jax.looped.tree import LoopTree, commit_root, loop_advance, prefill_all_depths
from lookahead_jax.looped.spec_sampling import DraftVerifier, verify_drafts
from lookahead_jax.looped.tree_method import (LoopStats, TreeMethod, discard_counts,
                                              loop_summary)
from lookahead_jax.sampling import Sampling
from models.config import ConfigError
from models.kv_cache import KVCache

@struct.dataclass
class LoopSpecState:
    cache: KVCache
    out: Output
    tree: LoopTree
    key: jax.Array
    steps: jax.Array  # [] int32: shared-block calls (batched steps), the prefill counted as one
    stats: LoopStats


def second_drafts(tree: LoopTree, at_d2: jax.Array, top: jax.Array, q: jax.Array,
                  sampling: Sampling, key: jax.Array):
    """The dual proposal for the nodes that just reached d2 (at_d2 [B, C]), beside their first
    child x1: greedy, the depth-d2 argmax `top` [B, C] when it differs from x1; sampling, a
    token from q2 = normalize(max(p_d2 - q1, 0)) when p_d2(x1) < q1(x1), q [B, C, V] the
    depth-d2 distribution. Returns (which nodes draft [B, C], tokens [B, C], their q)."""
    c = tree.capacity
    first = (tree.valid[:, None, :] & (tree.parent[:, None, :] == jnp.arange(c)[None, :, None])
             & (tree.kind[:, None, :] == 1))  # [B, C(node), C(child)]
    has1 = first.any(2)
    slot1 = jnp.argmax(first, axis=2)
    x1 = jnp.take_along_axis(tree.token, slot1, axis=1)  # [B, C]
    if sampling.greedy:
        return at_d2 & has1 & (top != x1), top, q
    q1 = jnp.take_along_axis(tree.q, slot1[..., None], axis=1)  # [B, C, V]
    p_x1 = jnp.take_along_axis(q, x1[..., None], axis=2)[..., 0]
    q1_x1 = jnp.take_along_axis(q1, x1[..., None], axis=2)[..., 0]
    q2 = jnp.maximum(q - q1, 0.0)
    q2 = q2 / jnp.maximum(q2.sum(-1, keepdims=True), 1e-30)
    draft2 = jax.random.categorical(key, jnp.log(q2), axis=-1).astype(jnp.int32)
    return at_d2 & has1 & (p_x1 < q1_x1), draft2, q2


def loopspec_step(model, state: LoopSpecState, *, d1: int, d2: int, sampling: Sampling,
                  eos_ids: tuple[int, ...], verifier: DraftVerifier = verify_drafts
                  ) -> LoopSpecState:
    """One LoopSpec step: advance the tree one loop; the root, at full depth, verifies its
    drafted children, commits and emits; nodes reaching d1 draft a child, nodes reaching d2
    (when d2 > 0) may draft a second one."""
    r_full = model.config.num_loops
    live = ~state.out.done
    depths = (d1, r_full) + ((d2,) if d2 else ())
    tree, cache, logits, active = loop_advance(model, state.tree, state.cache, live, depths)
    b, c = tree.valid.shape
    rows = jnp.arange(b)
    n_drafts = 2 if d2 else 1
    key, k_u, k_res, k_draft, k_draft2 = jax.random.split(state.key, 5)

    # the root at full depth verifies its children (draft kinds 1..n_drafts, in cascade)
    root = tree.root
    done_root = active[rows, root] & (tree.depth[rows, root] == r_full)  # [B]
    logits_r = logits[rows, root]  # [B, V]
    is_child = tree.valid & (tree.parent == root[:, None])  # [B, C]
    kinds = jnp.arange(1, n_drafts + 1)[None, :, None]
    of_kind = is_child[:, None, :] & (tree.kind[:, None, :] == kinds)  # [B, K, C]
    has = of_kind.any(2)
    slot = jnp.argmax(of_kind, axis=2).astype(jnp.int32)  # [B, K]
    x = jnp.take_along_axis(tree.token, slot, axis=1)  # [B, K]
    if sampling.greedy:
        nxt = jnp.argmax(logits_r, axis=-1).astype(jnp.int32)
        match = has & (x == nxt[:, None])
        which = jnp.where(match.any(1), jnp.argmax(match, axis=1), -1).astype(jnp.int32)
    else:
        p = jax.nn.softmax(sampling.log_probs(logits_r), axis=-1)
        u = jax.random.uniform(k_u, (b, n_drafts))
        q = jnp.take_along_axis(tree.q, slot[..., None], axis=1)  # [B, K, V]
        which, nxt = verifier(u, p, q, x, has, k_res)
    accept = which >= 0
    child = jnp.take_along_axis(slot, jnp.maximum(which, 0)[:, None], axis=1)[:, 0]
    cache = commit_root(cache, tree, done_root)
    out, _ = state.out.emit(nxt[:, None], done_root.astype(jnp.int32), eos_ids)
    keep = done_root & accept
    root_pos = tree.pos[rows, root]
    lost = discard_counts(tree, tree.discarded(keep, child, done_root & ~accept), r_full)
    tree = tree.keep_subtree(keep, child)
    tree = tree.restart(done_root & ~accept, nxt, root_pos + 1)

    # nodes that just reached d1 (and survived) draft a child
    reached = active & tree.valid & ~tree.fresh
    want = reached & (tree.depth == d1)
    if sampling.greedy:
        q = jnp.zeros((b, c, 1), jnp.float32)
        draft = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        q = jax.nn.softmax(sampling.log_probs(logits), axis=-1)  # [B, C, V]
        draft = jax.random.categorical(k_draft, jnp.log(q), axis=-1).astype(jnp.int32)
    kind = jnp.ones((b, c), jnp.int32)
    if d2:  # nodes that just reached d2 may draft a second child next to their first
        want2, draft2, q2 = second_drafts(tree, reached & (tree.depth == d2), draft, q,
                                          sampling, k_draft2)
        want = want | want2
        draft = jnp.where(want2, draft2, draft)
        q = jnp.where(want2[..., None], q2, q)
        kind = jnp.where(want2, 2, kind)
    tree, _ = tree.spawn(want, draft, q, kind)

    stats = state.stats.step(live, active, done_root, keep, keep & (which == 1), lost)
    return LoopSpecState(cache, out, tree, key, state.steps + 1, stats)


@dataclasses.dataclass(frozen=True)
class LoopSpec(TreeMethod):
    """LoopSpec (`--method=loopspec`): draft from the depth-d1 readout, start the child at
    once, verify at full depth; d2 > d1 adds the dual proposal at depth d2 (0: off).
    capacity: tree nodes per row (0: R // d1 + 1, the longest chain; twice that with d2).
    verifier: the acceptance rule when sampling (tests plant wrong ones)."""

    d1: int = 1
    d2: int = 0
    capacity: int = 0
    verifier: DraftVerifier = verify_drafts

    name = "loopspec"

    def __post_init__(self):
        super().__post_init__()
        if self.d1 < 1:
            raise ConfigError(f"loopspec: d1 must be >= 1, got {self.d1}")
        if self.d2 and self.d2 <= self.d1:
            raise ConfigError(f"loopspec: d2 must be above d1 ({self.d1}) or 0, got {self.d2}")
        if self.capacity < 0:
            raise ConfigError(f"loopspec: capacity must be >= 0, got {self.capacity}")

    def tree_capacity(self, num_loops: int) -> int:
        return self.capacity or (num_loops // self.d1 + 1) * (2 if self.d2 else 1)

    def depths(self) -> dict[str, int]:
        return {"d1": self.d1, "d2": self.d2}

    def prefill(self, model, tokens, lengths, cache):
        logits, cache = prefill_all_depths(model, tokens, lengths, cache,
                                           (self.d1, self.d2, model.config.num_loops))
        return logits, cache, None

    def start(self, model, params, first: First) -> LoopSpecState:
        """A one-node tree per row: the first token at its position, depth 0."""
        return LoopSpecState(first.cache, first.out, self.new_tree(model, first), first.key,
                             jnp.ones((), jnp.int32),
                             LoopStats.zeros(first.tokens.shape[0]))

    def step(self, model, params, state: LoopSpecState, *, eos_ids) -> LoopSpecState:
        return loopspec_step(model, state, d1=self.d1, d2=self.d2, sampling=self.sampling,
                             eos_ids=eos_ids, verifier=self.verifier)

    def summary(self, state: LoopSpecState) -> dict:
        return {"d1": self.d1, "d2": self.d2, "capacity": state.tree.capacity,
                **loop_summary(state.stats)}
