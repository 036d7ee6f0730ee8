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
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from lookahead_jax.generation import Output, run_steps
from lookahead_jax.loop_tree import LoopTree, commit_root, loop_advance, prefill_all_depths
from lookahead_jax.sampling import Sampling
from models.config import ConfigError
from models.kv_cache import KVCache

# (uniforms u [B,K], target p [B,V], drafts' distributions q [B,K,V], drafted tokens x [B,K],
#  which drafts exist has [B,K], key) -> (accepted draft [B] int32, -1 for none; token [B])
DraftVerifier = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array],
                         tuple[jax.Array, jax.Array]]


def verify_drafts(u: jax.Array, p: jax.Array, q: jax.Array, x: jax.Array, has: jax.Array,
                  key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling of K drafted tokens in cascade: draft k (when it exists and none
    before it was accepted) is accepted with probability min(1, r(x_k) / q_k(x_k)), r the
    residual target (p at first); on its rejection r becomes normalize(max(r - q_k, 0)).
    With none accepted the token is drawn from the final residual. Keeps p exactly.
    u [B, K] uniform in [0, 1); p [B, V]; q [B, K, V]; x [B, K]; has [B, K]."""
    b, k_drafts = x.shape
    rows = jnp.arange(b)
    res = p
    which = jnp.full((b,), -1, jnp.int32)
    for k in range(k_drafts):
        trial = has[:, k] & (which < 0)
        xk = x[:, k]
        total = res.sum(-1)
        accept = trial & (u[:, k] * q[rows, k, xk] * total < res[rows, xk])  # u < r/q
        which = jnp.where(accept, k, which)
        rejected = trial & ~accept
        res = jnp.where(rejected[:, None], residual_after(res, q[:, k]), res)
    drawn = jax.random.categorical(key, jnp.log(res), axis=-1).astype(jnp.int32)
    token = jnp.where(which >= 0, x[rows, jnp.maximum(which, 0)], drawn)
    return which, token


def residual_after(res: jax.Array, qk: jax.Array) -> jax.Array:
    """The target left after rejecting a draft from qk: max(normalize(res) - qk, 0)
    (unnormalised), or res itself where that is empty (res == qk: the draft is never
    rejected). res, qk [..., V]."""
    total = res.sum(-1, keepdims=True)
    nxt = jnp.maximum(res / jnp.maximum(total, 1e-30) - qk, 0.0)
    return jnp.where(nxt.sum(-1, keepdims=True) > 0, nxt, res)


def draft_chances(p: jax.Array, q: jax.Array, x: jax.Array, has: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`verify_drafts`'s cascade in expectation, for drafted tokens already drawn: against
    target p [..., V], drafts x [..., K] from q [..., K, V] (where has [..., K]) returns each
    draft's probability of being the accepted one [..., K], the probability that all are
    rejected [...], and the final residual (unnormalised) [..., V], the distribution the
    token is then drawn from. LoopAhead uses it with an early readout in place of p to decide
    which children to pause and what to propose next."""
    res = p
    none = jnp.ones(p.shape[:-1], jnp.float32)
    chances = []
    for k in range(x.shape[-1]):
        xk = x[..., k:k + 1]
        r_x = (jnp.take_along_axis(res, xk, axis=-1)[..., 0]
               / jnp.maximum(res.sum(-1), 1e-30))
        q_x = jnp.take_along_axis(q[..., k, :], xk, axis=-1)[..., 0]
        acc = jnp.where(has[..., k], jnp.minimum(1.0, r_x / jnp.maximum(q_x, 1e-30)), 0.0)
        chances.append(none * acc)
        none = none * (1.0 - acc)
        res = jnp.where(has[..., k:k + 1], residual_after(res, q[..., k, :]), res)
    return jnp.stack(chances, axis=-1), none, res


@struct.dataclass
class LoopStats:
    loops: jax.Array  # [B] int32, shared-block calls while the row was live
    advances: jax.Array  # [B] int32, node-loops (candidate advances) of the row
    verified: jax.Array  # [B] int32, full-depth verifications (= tokens emitted after the first)
    accepted: jax.Array  # [B] int32, drafted children that survived verification
    accepted_second: jax.Array  # [B] int32, of which second (d2) / drafter (LoopAhead) drafts

    @classmethod
    def zeros(cls, b: int) -> "LoopStats":
        z = jnp.zeros((b,), jnp.int32)
        return cls(z, z, z, z, z)


@struct.dataclass
class LoopSpecState:
    cache: KVCache
    out: Output
    tree: LoopTree
    key: jax.Array
    steps: jax.Array  # [] int32: shared-block calls (batched steps), the prefill counted as one
    stats: LoopStats


def check_looped(model) -> None:
    if not hasattr(model.config, "num_loops"):
        raise ConfigError("loopspec / loopahead need a looped model (an Ouro or Raven preset, "
                          "e.g. --config=tiny_ouro); this model is not looped")


def check_scratch_room(cache: KVCache, prompt_bucket: int, max_new_tokens: int,
                       capacity: int) -> None:
    """The tree's scratch positions (the last `capacity` of the cache) must lie beyond every
    position a committed token can take."""
    room = cache.max_len - prompt_bucket - max_new_tokens
    if capacity > room:
        raise ConfigError(f"the candidate tree needs {capacity} scratch positions after the "
                          f"prompt (padded to {prompt_bucket}) and {max_new_tokens} new tokens, "
                          f"but the cache of {cache.max_len} leaves {room}: raise cache_len")


def loopspec_init(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array,
                  lengths: jax.Array, cache: KVCache, key: jax.Array, *,
                  readout_depths: tuple[int, ...], capacity: int, sampling: Sampling,
                  max_new_tokens: int, eos_ids: tuple[int, ...]) -> LoopSpecState:
    """Prefill (every depth's K/V; Raven's coda at `readout_depths`), the first token, a
    one-node tree per row. tokens [B, P] right-padded, lengths [B]."""
    model = nnx.merge(graphdef, params)
    check_looped(model)
    cfg = model.config
    logits, cache = prefill_all_depths(model, tokens, lengths, cache, readout_depths)
    key, sub = jax.random.split(key)
    first = sampling.sample(sub, logits)
    b = tokens.shape[0]
    out, _ = Output.init(b, max_new_tokens).emit(first[:, None], jnp.ones_like(lengths), eos_ids)
    q_size = 1 if sampling.greedy else cfg.vocab_size
    tree = LoopTree.init(first, lengths.astype(jnp.int32), capacity, cfg.hidden_size,
                         model.dtype, q_size)
    return LoopSpecState(cache, out, tree, key, jnp.ones((), jnp.int32), LoopStats.zeros(b))


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
        first = (tree.valid[:, None, :] & (tree.parent[:, None, :] == jnp.arange(c)[None, :, None])
                 & (tree.kind[:, None, :] == 1))  # [B, C(node), C(child)]
        has1 = first.any(2)
        slot1 = jnp.argmax(first, axis=2)
        x1 = jnp.take_along_axis(tree.token, slot1, axis=1)  # [B, C]
        if sampling.greedy:
            want2 = reached & (tree.depth == d2) & has1 & (draft != x1)
            draft2, q2 = draft, q
        else:
            q1 = jnp.take_along_axis(tree.q, slot1[..., None], axis=1)  # [B, C, V]
            p_x1 = jnp.take_along_axis(q, x1[..., None], axis=2)[..., 0]
            q1_x1 = jnp.take_along_axis(q1, x1[..., None], axis=2)[..., 0]
            want2 = reached & (tree.depth == d2) & has1 & (p_x1 < q1_x1)
            q2 = jnp.maximum(q - q1, 0.0)
            q2 = q2 / jnp.maximum(q2.sum(-1, keepdims=True), 1e-30)
            draft2 = jax.random.categorical(k_draft2, jnp.log(q2), axis=-1).astype(jnp.int32)
        want = want | want2
        draft = jnp.where(want2, draft2, draft)
        q = jnp.where(want2[..., None], q2, q)
        kind = jnp.where(want2, 2, kind)
    tree, _ = tree.spawn(want, draft, q, kind)

    live_i = live.astype(jnp.int32)
    st = state.stats
    stats = LoopStats(st.loops + live_i, st.advances + active.sum(1, dtype=jnp.int32),
                      st.verified + done_root.astype(jnp.int32),
                      st.accepted + keep.astype(jnp.int32),
                      st.accepted_second + (keep & (which == 1)).astype(jnp.int32))
    return LoopSpecState(cache, out, tree, key, state.steps + 1, stats)


def loopspec_run(graphdef: nnx.GraphDef, params: nnx.State, state: LoopSpecState,
                 max_steps: jax.Array, *, d1: int, d2: int, sampling: Sampling,
                 eos_ids: tuple[int, ...], verifier: DraftVerifier = verify_drafts
                 ) -> LoopSpecState:
    """Up to `max_steps` LoopSpec steps (or until every row is done) in one while_loop."""
    model = nnx.merge(graphdef, params)
    return run_steps(lambda s: loopspec_step(model, s, d1=d1, d2=d2, sampling=sampling,
                                             eos_ids=eos_ids, verifier=verifier),
                     state, max_steps)


def loop_summary(stats: LoopStats, num_loops: int | None = None) -> dict:
    """Host side: loops and candidate advances per output token (the first token, from the
    prefill, not counted), and the share of verifications that kept the drafted child."""
    loops, adv = int(np.sum(stats.loops)), int(np.sum(stats.advances))
    ver, acc = int(np.sum(stats.verified)), int(np.sum(stats.accepted))
    d = {"loops": loops, "advances": adv, "verified_tokens": ver,
         "loops_per_token": loops / ver if ver else float("nan"),
         "advances_per_token": adv / ver if ver else float("nan"),
         "draft_acceptance": acc / ver if ver else float("nan"),
         "second_draft_accepted": int(np.sum(stats.accepted_second))}
    if num_loops is not None:
        d["plain_loops_per_token"] = num_loops
    return d


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """LoopSpec (`--method=loopspec`): draft from the depth-d1 readout, start the child at
    once, verify at full depth; d2 > d1 adds the dual proposal at depth d2 (0: off).
    capacity: tree nodes per row (0: R // d1 + 1, the longest chain; twice that with d2).
    verifier: the acceptance rule when sampling (tests plant wrong ones)."""

    sampling: Sampling = Sampling()
    d1: int = 1
    d2: int = 0
    capacity: int = 0
    verifier: DraftVerifier = verify_drafts

    def __post_init__(self):
        if self.d1 < 1:
            raise ConfigError(f"loopspec: d1 must be >= 1, got {self.d1}")
        if self.d2 and self.d2 <= self.d1:
            raise ConfigError(f"loopspec: d2 must be above d1 ({self.d1}) or 0, got {self.d2}")
        if self.capacity < 0:
            raise ConfigError(f"loopspec: capacity must be >= 0, got {self.capacity}")

    def tree_capacity(self, num_loops: int) -> int:
        return self.capacity or (num_loops // self.d1 + 1) * (2 if self.d2 else 1)

    @property
    def step_tokens(self) -> int:
        # cache room for the tree's scratch positions (the engine sizes the cache before the
        # model's R is known; init checks the room against the tree's capacity)
        return self.capacity or 32

    def init(self, graphdef, params, tokens, lengths, cache, key, *, max_new_tokens, eos_ids,
             vocab_size):
        model = nnx.merge(graphdef, params)
        check_looped(model)
        r_full = model.config.num_loops
        if max(self.d1, self.d2) >= r_full:
            raise ConfigError(f"loopspec: d1 ({self.d1}) and d2 ({self.d2}) must be below the "
                              f"model's {r_full} loops")
        capacity = self.tree_capacity(r_full)
        check_scratch_room(cache, tokens.shape[1], max_new_tokens, capacity)
        return loopspec_init(graphdef, params, tokens, lengths, cache, key,
                             readout_depths=(self.d1, self.d2, r_full), capacity=capacity,
                             sampling=self.sampling, max_new_tokens=max_new_tokens,
                             eos_ids=eos_ids)

    def run(self, graphdef, params, state, max_steps, *, eos_ids):
        return loopspec_run(graphdef, params, state, max_steps, d1=self.d1, d2=self.d2,
                            sampling=self.sampling, eos_ids=eos_ids, verifier=self.verifier)

    def summary(self, state: LoopSpecState) -> dict:
        return {"d1": self.d1, "d2": self.d2, "capacity": state.tree.capacity,
                **loop_summary(state.stats)}
