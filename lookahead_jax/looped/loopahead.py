"""LoopAhead: a candidate tree of tokens at different loop depths, drafted early by the looped
model's native proposals and a lookahead drafter (LAD), paused by intermediate-loop feedback,
decided by the full-depth readout alone (`--method=loopahead`, looped models). Greedy and
sampling.

Each step is one batched call of the shared block over the scheduled nodes of the tree
(`tree.loop_advance`), then:

1. Verification and commit (possibly several tokens): while the root is at full depth R, its
   token is decided and emitted and its K/V committed; the child holding that token becomes
   the root (the other subtrees are pruned), else the emitted token restarts as a fresh root.
   A drafted chain that advanced as one block reaches R together, so a whole accepted chain
   commits in one step.
2. Drafts at depth r1: a node reaching r1 proposes its readout's argmax (the native proposal,
   the anchor). Admission: a node with no child yet that is not suspended gets the anchor as
   a child and, below it, a chain of the drafter's K tokens (at most `lad_calls` drafter calls
   per row and step, in priority order, each over the depth-r1 states and native proposals
   of the last `window` positions: committed tokens and the node's ancestors); all of them
   start at depth 0 and advance together. Calls recur: the chain's last node, and every
   anchor, reaching r1 childless is eligible in its turn (as far as the tree's capacity
   admits the new nodes: a chain is cut at the free slots). A node whose children do
   not include its anchor gets the anchor as an extra child. The drafter's vocabulary is its
   compact one (the teacher outputs' most frequent tokens) and, when its head can score any
   token (`train_lad` head "model"), the request's own tokens too: the prompt's, EOS and the
   outputs so far (`request_tokens`, a fixed number of slots).
3. Feedback from depth r2 (scheduling): a node reaching r2 pauses every child whose token
   differs from its depth-r2 argmax, which suspends the child's subtree (K/V kept, not
   advanced), and adds that argmax as a child when none holds it. Each later intermediate
   readout (depths r2 + 1 .. R - 1) that agrees with one of the children judges them again:
   that one resumes (eligible again), the others pause (a readout agreeing with none
   changes nothing: no proposal is added after r2). An accepted child resumes (it becomes
   the root).
4. Retention (sampling, `retain="calibrated"`): the drafter is called for a node only when
   the best first token its `Calibration` knows could pay for its node (the anchor's chance
   under the r1 readout times that token's best calibrated match probability exceeds
   `node_cost`), and of the K drafted tokens the chain keeps the first L, L maximising the
   expected accepted tokens minus `node_cost` per kept node (`retained_length`; the shorter
   on ties). Greedy keeps all K (as the tree's free slots allow), as by default.
5. Budget: at most `max_active` nodes advance per step (0: all eligible), by priority
   (`priority_rank`): nearest position first, then the deeper node; a node never runs deeper
   than its ancestors (suspension covers whole subtrees).

Counted for the ablations (`loop_summary`): the drafted nodes verification discards, the
loops they had taken, and how many had reached full depth.

Greedy: the root's token is its full-depth argmax; output equals plain full-depth greedy
decoding token for token whatever the drafts.

Sampling (temperature, top-k, top-p; p and every q warped by `Sampling`): every child records
the distribution q its token was drawn from, and a node has at most one child of each kind,
made in a fixed order: the drafter's token (a deterministic proposal, q one-hot), the anchor
(at r1), the feedback proposal (at r2). The root at full depth, with target p, walks its
children in that order with the standard speculative-sampling cascade (LoopSpec's
`verify_drafts`): child x is accepted with probability min(1, r(x) / q(x)), r the residual
target (p at first); on rejection r becomes normalize(max(r - q, 0)); with none accepted the
token is drawn from the final residual. Each proposal is drawn from what the earlier ones
leave (`draft_chances`, the cascade in expectation, with the early readout in place of p):
the anchor from the r1 distribution's residual after the drafter's token, the feedback
proposal from the r2 distribution's residual after the existing children, made only when that
residual is not empty (so a token that would certainly be accepted is never repeated). A
child's existence and q depend only on earlier children, never on its own token, so each
emitted token is distributed exactly as plain sampling at full depth. Scheduling at r2 and later
readouts can keep running the child most likely to be accepted under that depth's distribution
(at r2 the new proposal included) and pause the others, the greedy rule's counterpart
(`suspend_below=1`). Without a budget, sampling pauses no child by default (`suspend_below`
0): the token verification accepts is drawn, often not the likeliest, and pausing it costs
loops (on smol_loop at T = 0.7, 0.539 of plain's loops per token paused against 0.488 not, at
half the advances: benchmarks/README.md). Under a budget (`max_active`) the default is 1: a
paused child frees its slot for likelier nodes, and pausing saves loops (tiny_ouro, T = 0.7,
budget 4: 0.374 of plain's loops per token against 0.477). Any threshold keeps the
distribution exact: pausing decides when a node runs, never what is emitted.

Counts as LoopSpec: loops (shared-block calls) and candidate advances per output token;
`drafter_accepted`: verifications that kept the drafter's child.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from lookahead_jax.generation import Output
from lookahead_jax.looped.drafter import (calibrated_table, match_probability,
                                          output_embedding)
from lookahead_jax.looped.tree_method import (LoopStats, TreeMethod, discard_counts,
                                              loop_summary)
from lookahead_jax.looped.spec_sampling import DraftVerifier, draft_chances, verify_drafts
from lookahead_jax.looped.tree import LoopTree, commit_root, loop_advance, prefill_all_depths
from lookahead_jax.method import First
from models.config import ConfigError
from models.kv_cache import KVCache


def request_tokens(prompt: jax.Array, out: Output, eos_ids: tuple[int, ...]) -> jax.Array:
    """The request's own tokens, which join the drafter's vocabulary at inference (when its
    head can score them): the prompt's [B, P] (-1 past its length), the outputs so far, EOS.
    Returns [B, P + max_new_tokens + len(eos_ids)] int32, -1 in empty slots."""
    b, m = out.tokens.shape
    outputs = jnp.where(jnp.arange(m)[None] < out.count[:, None], out.tokens, -1)
    eos = jnp.broadcast_to(jnp.asarray(eos_ids, jnp.int32).reshape(1, -1), (b, len(eos_ids)))
    return jnp.concatenate([prompt, outputs, eos], axis=1).astype(jnp.int32)


def suspended(tree: LoopTree, paused: jax.Array) -> jax.Array:
    """[B, C] the nodes that do not advance: paused [B, C] themselves or below a paused node."""
    return paused | (tree.anc & paused[:, None, :]).any(-1)


def priority_rank(tree: LoopTree, among: jax.Array) -> jax.Array:
    """[B, C] each node's place in the scheduling priority among the nodes `among` [B, C]
    (the count of those ahead of it): the nearest position first (the next token to be
    decided), then the deeper node (the nearer its verdict), then the lower slot. A node's
    ancestors always come before it, so a budget never runs a node past its ancestors."""
    c = tree.capacity
    pos_j, pos_i = tree.pos[:, None, :], tree.pos[:, :, None]
    d_j, d_i = tree.depth[:, None, :], tree.depth[:, :, None]
    slot = jnp.arange(c)
    earlier_slot = slot[None, None, :] < slot[None, :, None]
    ahead = (pos_j < pos_i) | ((pos_j == pos_i) & ((d_j > d_i) | ((d_j == d_i) & earlier_slot)))
    return (among[:, None, :] & ahead).sum(-1)


def retained_length(anchor_chance: jax.Array, match: jax.Array, node_cost: float) -> jax.Array:
    """How many of a chain's K drafted tokens to keep: anchor_chance [B] (the chance that the
    anchor they follow is accepted), match [B, K] (each drafted token's calibrated chance of
    being accepted after the earlier ones), node_cost (the expected tokens a kept node must
    earn: its execution cost). Token j is accepted with probability
    anchor_chance * prod_{i <= j} match_i; returns the L in 0..K [B] maximising the sum of
    those over j <= L minus node_cost * L, the smallest such L on ties."""
    survive = anchor_chance[:, None] * jnp.cumprod(match, axis=-1)
    gain = jnp.cumsum(survive - node_cost, axis=-1)
    gain = jnp.concatenate([jnp.zeros_like(gain[:, :1]), gain], axis=-1)
    return jnp.argmax(gain, axis=-1).astype(jnp.int32)  # the first maximum: the shortest


RETAIN = ("all", "calibrated")


# the proposals that make children, in the order they are made for a node and verified:
# the drafter's (chained below an anchor when it is made), the anchor (at the node's r1), the
# feedback proposal (at its r2)
KIND_ANCHOR, KIND_FEEDBACK, KIND_LAD = 1, 2, 3
KINDS = (KIND_LAD, KIND_ANCHOR, KIND_FEEDBACK)


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
    prompt: jax.Array  # [B, P] int32 the prompt's tokens, -1 past its length
    key: jax.Array
    steps: jax.Array
    stats: LoopStats


@dataclasses.dataclass(frozen=True)
class LoopAhead(TreeMethod):
    """LoopAhead decoding, greedy or sampling. r1: draft depth (native proposals and LAD; a
    drafter's states come from its own `draft_depth`, which r1 must equal); r2: feedback depth
    (0: off); drafter: a `LadDrafter` (None: native proposals only, the "drafter off"
    ablation); scheduling: feedback from r2 on (suspension, resumption and the r2 proposal)
    on / off (the "scheduling off" ablation); max_active: the budget, nodes advanced per step
    in priority order (0: all eligible); lad_calls: drafter calls per row and step (each from
    an eligible node at r1); suspend_below (sampling): a child the feedback readout gives
    at least this chance of acceptance keeps running beside the likeliest (0: none pauses,
    fewest loops; 1: only the likeliest runs, the greedy rule's counterpart, fewest advances;
    None, the default: 0 without a budget, 1 with one, where a paused child frees its slot
    for likelier nodes); retain (sampling): "all" (a chain keeps
    the drafter's K tokens) or "calibrated" (calls and chain lengths chosen from the
    drafter's `Calibration` and node_cost, the execution cost of a node in expected tokens;
    module docstring, step 4); window: the drafter's context positions;
    capacity: tree nodes (0: automatic); verifier: the acceptance rule when sampling (tests
    plant wrong ones). `lookahead_jax.registry` builds it with r1 taken from the drafter."""

    r1: int = 1
    r2: int = 2
    drafter: Any = None
    scheduling: bool = True
    max_active: int = 0
    lad_calls: int = 1
    suspend_below: float | None = None
    retain: str = "all"
    node_cost: float = 0.1
    window: int = 32
    capacity: int = 0
    verifier: DraftVerifier = verify_drafts

    name = "loopahead"

    def __post_init__(self):
        super().__post_init__()
        if self.r1 < 1 or (self.r2 and self.r2 <= self.r1):
            raise ConfigError(f"loopahead: need 1 <= r1 < r2 (or r2 = 0), got {self.r1}, "
                              f"{self.r2}")
        if self.suspend_below is None:  # the default follows the budget (class docstring)
            budgeted = self.max_active > 0 and not self.sampling.greedy
            object.__setattr__(self, "suspend_below", 1.0 if budgeted else 0.0)
        if not 0.0 <= self.suspend_below <= 1.0:
            raise ConfigError(f"loopahead: suspend_below must lie in [0, 1], got "
                              f"{self.suspend_below}")
        if self.suspend_below and self.sampling.greedy:
            raise ConfigError("loopahead: suspend_below applies when sampling; greedy feedback "
                              "runs only the readout's argmax child (set a temperature, or "
                              "drop suspend_below)")
        if self.max_active < 0 or self.lad_calls < 1:
            raise ConfigError(f"loopahead: need max_active >= 0 (0: no budget) and lad_calls "
                              f">= 1, got {self.max_active}, {self.lad_calls}")
        if self.retain not in RETAIN:
            raise ConfigError(f"loopahead: retain must be one of {', '.join(RETAIN)}, got "
                              f"{self.retain!r}")
        if not self.node_cost >= 0:
            raise ConfigError(f"loopahead: node_cost must be >= 0, got {self.node_cost}")
        if self.retain == "calibrated":
            if self.sampling.greedy:
                raise ConfigError("loopahead: retain='calibrated' chooses chain lengths when "
                                  "sampling; greedy decoding keeps every drafted token (set a "
                                  "temperature, or drop retain)")
            if getattr(self.drafter, "calibration", None) is None:
                raise ConfigError("loopahead: retain='calibrated' needs a drafter with a "
                                  "calibration (python -m train_lad.calibrate adds one)")
        depth = getattr(self.drafter, "draft_depth", None)
        if depth is not None and depth != self.r1:
            raise ConfigError(f"loopahead: the drafter was trained on depth-{depth} states, "
                              f"but r1 is {self.r1} (r1 must equal the drafter's draft depth)")

    @property
    def K(self) -> int:
        return self.drafter.K if self.drafter is not None else 0

    def tree_capacity(self, num_loops: int) -> int:
        """`capacity`, or automatic: room for two drafted chains (K + 2 nodes each) and one
        node per r1 loops of depth; twice that when sampling, where nearly every node also
        gets a feedback proposal (the r2 readout almost always leaves some chance to the
        tokens its children do not hold), which would otherwise fill the tree and crowd out
        the drafter's chains (tiny_ouro, T = 0.7: loops per token 0.394 of plain's with 16
        nodes, 0.286 with 32)."""
        auto = (self.K + 2) * 2 + num_loops // self.r1 + 2
        return self.capacity or (auto if self.sampling.greedy else 2 * auto)

    def depths(self) -> dict[str, int]:
        return {"r1": self.r1, "r2": self.r2}

    def params(self):
        return self.drafter.params if self.drafter is not None else {}

    def prefill(self, model, tokens, lengths, cache):
        logits, cache, h1, nat = prefill_all_depths(
            model, tokens, lengths, cache, (self.r1, self.r2, model.config.num_loops),
            keep_depth=self.r1)
        return logits, cache, (h1, nat)

    def start(self, model, params, first: First) -> LoopAheadState:
        """A one-node tree per row, and the prompt's depth-r1 states and native proposals
        as the drafter's committed context."""
        cfg = model.config
        tokens, lengths = first.tokens, first.lengths
        tree = self.new_tree(model, first)
        capacity = tree.capacity
        h1, nat = first.aux
        b, p = tokens.shape
        s = first.cache.max_len
        ctx_h1 = jnp.zeros((b, s, cfg.hidden_size), h1.dtype).at[:, :p].set(h1)
        ctx_nat = jnp.zeros((b, s), jnp.int32).at[:, :p].set(nat)
        prompt = jnp.where(jnp.arange(p)[None] < lengths[:, None], tokens, -1)
        return LoopAheadState(first.cache, first.out, tree, jnp.zeros((b, capacity), bool),
                              jnp.zeros((b, capacity, cfg.hidden_size), h1.dtype),
                              jnp.zeros((b, capacity), jnp.int32), ctx_h1, ctx_nat,
                              prompt.astype(jnp.int32), first.key, jnp.ones((), jnp.int32),
                              LoopStats.zeros(b))

    def prepare(self, model, params):
        """The drafter's weights and, loop-invariant, its output embedding (a normalised copy
        of the model's), computed once per `run`."""
        out_emb = output_embedding(model) if self.drafter is not None else None
        return {"drafter": params, "out_embedding": out_emb}

    def summary(self, state: LoopAheadState) -> dict:
        st = loop_summary(state.stats)
        st["drafter_accepted"] = st.pop("second_draft_accepted")
        arch = getattr(self.drafter, "arch", None)  # a LadDrafter's: "queries" | "heads"
        return {"r1": self.r1, "r2": self.r2, "K": self.K, "drafter_arch": arch,
                # a drafter with a residual head: the loop its backbone was trained on
                "drafter_backbone_depth": getattr(self.drafter, "backbone_depth", None),
                "scheduling": self.scheduling, "max_active": self.max_active,
                "lad_calls": self.lad_calls, "suspend_below": self.suspend_below,
                "retain": self.retain, "node_cost": self.node_cost,
                "capacity": state.tree.capacity, **st}

    # -- one step ---------------------------------------------------------------------------
    def step(self, model, params, state: LoopAheadState, *, eos_ids) -> LoopAheadState:
        """One LoopAhead step (see the module docstring): schedule and advance the tree one
        loop, then 1. verify and commit, 3. feedback at r2, 2. drafts at r1. params: what
        `prepare` made (the drafter's weights and the model's output embedding)."""
        r_full = model.config.num_loops
        live = ~state.out.done
        tree = state.tree
        key, k_verify, k_anchor, k_feedback = jax.random.split(state.key, 4)

        # schedule: valid, not suspended (paused itself or below a paused node), below R;
        # within the budget by priority (`priority_rank`)
        run = (tree.valid & ~suspended(tree, state.paused) & (tree.depth < r_full)
               & live[:, None])
        if self.max_active:
            run = run & (priority_rank(tree, run) < self.max_active)
        depths = (self.r1, self.r2, r_full)
        tree, cache, logits, active = loop_advance(model, tree, state.cache, live, depths, run)
        top = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, C] at each node's depth
        # sampling: each node's warped distribution at its depth [B, C, V]
        probs = (None if self.sampling.greedy
                 else jax.nn.softmax(self.sampling.log_probs(logits), axis=-1))
        at_r1 = active & (tree.depth == self.r1)
        state = state.replace(h1=jnp.where(at_r1[..., None], tree.h, state.h1),
                              native=jnp.where(at_r1, top, state.native))

        state, tree, cache, counts = self._verify_and_commit(state, tree, cache, top, probs,
                                                             k_verify, r_full, eos_ids)
        at_r1 = at_r1 & tree.valid & ~tree.fresh
        paused = state.paused
        if self.r2 and self.scheduling:
            tree, paused = self._feedback(tree, paused, active, top, probs, k_feedback, r_full)
        tree = self._spawn_drafts(params, state, tree, cache, at_r1, suspended(tree, paused),
                                  probs, k_anchor, eos_ids)
        stats = state.stats.step(live, active, *counts)
        return state.replace(cache=cache, tree=tree, paused=paused & tree.valid, key=key,
                             steps=state.steps + 1, stats=stats)

    def _verify_and_commit(self, state: LoopAheadState, tree: LoopTree, cache: KVCache, top,
                           probs, key, r_full: int, eos_ids):
        """1. While the root is at full depth R: decide its token (greedy: its argmax;
        sampling: its children in cascade), emit it, commit its K/V and its depth-r1 context,
        and make the child holding the token the root (else restart from the token). Up to
        K + 2 tokens per step. Returns the state (out, paused, context updated), the tree,
        the cache and per-row counts (verified, accepted, accepted drafter children, and
        `discard_counts` of the nodes thrown away)."""
        b, c = tree.valid.shape
        rows, slots = jnp.arange(b), jnp.arange(c)
        out, paused = state.out, state.paused
        ctx_h1, ctx_nat = state.ctx_h1, state.ctx_native
        verified = jnp.zeros((b,), jnp.int32)
        accepted = jnp.zeros((b,), jnp.int32)
        accepted_lad = jnp.zeros((b,), jnp.int32)
        lost = (jnp.zeros((b,), jnp.int32),) * 3
        going = ~out.done
        verify_keys = jax.random.split(key, 2 * (self.K + 2))
        for it in range(self.K + 2):
            root = tree.root
            at_r = going & tree.valid[rows, root] & (tree.depth[rows, root] == r_full)
            if self.sampling.greedy:
                nxt = top[rows, root]
                match = (tree.valid & (tree.parent == root[:, None])
                         & (tree.token == nxt[:, None]))
                keep = at_r & match.any(1)
                child = jnp.argmax(match, axis=1).astype(jnp.int32)
            else:  # the root's children in creation order, speculative sampling in cascade
                slot, has = self._children(tree)
                slot, has = slot[rows, root], has[rows, root]  # [B, KINDS]
                x = jnp.take_along_axis(tree.token, slot, axis=1)
                q = tree.q[rows[:, None], slot]  # [B, KINDS, V]
                u = jax.random.uniform(verify_keys[2 * it], x.shape)
                which, nxt = self.verifier(u, probs[rows, root], q, x, has,
                                           verify_keys[2 * it + 1])
                keep = at_r & (which >= 0)
                child = jnp.take_along_axis(slot, jnp.maximum(which, 0)[:, None], axis=1)[:, 0]
            cache_pos = cache.length
            ctx_h1 = ctx_h1.at[rows, jnp.where(at_r, cache_pos, ctx_h1.shape[1])].set(
                state.h1[rows, root], mode="drop")
            ctx_nat = ctx_nat.at[rows, jnp.where(at_r, cache_pos, ctx_nat.shape[1])].set(
                state.native[rows, root], mode="drop")
            cache = commit_root(cache, tree, at_r)
            out, _ = out.emit(nxt[:, None], at_r.astype(jnp.int32), eos_ids)
            accepted_lad += (keep & (tree.kind[rows, child] == KIND_LAD)).astype(jnp.int32)
            root_pos = tree.pos[rows, root]
            restart = at_r & ~keep
            lost = tuple(a + n for a, n in zip(
                lost, discard_counts(tree, tree.discarded(keep, child, restart), r_full)))
            tree = tree.keep_subtree(keep, child)
            tree = tree.restart(restart, nxt, root_pos + 1)
            paused = jnp.where(restart[:, None], False, paused)  # a kept root resumes
            paused = paused & tree.valid & (slots[None] != tree.root[:, None])
            verified += at_r.astype(jnp.int32)
            accepted += keep.astype(jnp.int32)
            going = keep & ~out.done
        state = state.replace(out=out, paused=paused, ctx_h1=ctx_h1, ctx_native=ctx_nat)
        return state, tree, cache, (verified, accepted, accepted_lad, lost)

    def _feedback(self, tree: LoopTree, paused, active, top, probs, key, r_full: int):
        """3. Feedback at every intermediate readout from r2 up to (not including) R: the
        children a node's latest readout judges unlikely to survive the full-depth verdict
        pause (with their subtrees) and the one it favours resumes; at r2 the readout's own
        proposal joins as a child."""
        b, c = tree.valid.shape
        rows = jnp.arange(b)
        reads = (active & tree.valid & ~tree.fresh & (tree.depth >= self.r2)
                 & (tree.depth < r_full))
        at_r2 = reads & (tree.depth == self.r2)
        kids = tree.children()
        if not self.sampling.greedy:
            return self._feedback_sampling(tree, paused, probs, reads, at_r2, kids.any(-1),
                                           key)
        # greedy: every child but the readout's argmax pauses, the argmax's resumes; at r2
        # the argmax is added when no child holds it; after r2, a readout that no child
        # agrees with leaves the children as they were (nothing would run in their place)
        par = jnp.maximum(tree.parent, 0)
        has_fb = (kids & (tree.token[:, None, :] == top[:, :, None])).any(-1)
        reads = at_r2 | (reads & has_fb)
        judged = tree.valid & (tree.parent >= 0) & reads[rows[:, None], par]
        paused = jnp.where(judged, tree.token != top[rows[:, None], par], paused)
        tree, _ = tree.spawn(at_r2 & kids.any(-1) & ~has_fb, top,
                             jnp.zeros((b, c, 1), jnp.float32), KIND_FEEDBACK)
        return tree, paused

    def _spawn_drafts(self, params, state: LoopAheadState, tree: LoopTree, cache: KVCache,
                      at_r1, held, probs, key, eos_ids) -> LoopTree:
        """2. Drafts at r1: the anchor (native proposal) for the nodes that just reached r1;
        admission: the drafter's chain of K tokens below the anchor for at most `lad_calls`
        of them per row and step, each without children yet and not suspended (held [B, C]),
        taken in scheduling priority."""
        b, c = tree.valid.shape
        rows, slots = jnp.arange(b), jnp.arange(c)
        greedy = self.sampling.greedy
        q_none = jnp.zeros((b, c, 1), jnp.float32)
        kids = tree.children()
        has_kid = kids.any(-1)
        if greedy:  # the anchor is the r1 argmax, added when no child holds it
            anchor, q_anchor = state.native, q_none
            has_anchor = (kids & (tree.token[:, None, :] == anchor[:, :, None])).any(-1)
            want_anchor = at_r1 & ~has_anchor
        else:  # drawn from what the r1 readout leaves after the node's existing children
            slot, has = self._children(tree)
            x, q = tree.token[rows[:, None, None], slot], tree.q[rows[:, None, None], slot]
            _, left, res = draft_chances(probs, q, x, has)
            q_anchor = res / jnp.maximum(res.sum(-1, keepdims=True), 1e-30)
            anchor = jax.random.categorical(key, jnp.log(q_anchor), axis=-1).astype(jnp.int32)
            want_anchor = at_r1 & (left > 0)
        if self.drafter is None:
            return tree.spawn(want_anchor, anchor, q_anchor, KIND_ANCHOR)[0]
        eligible = at_r1 & ~has_kid & ~held
        calibrated = self.retain == "calibrated" and not greedy
        if calibrated:  # a call only where its best first token could pay for its node
            cal = params["drafter"]["calibration"]
            best = calibrated_table(cal, self.sampling.temperature)[0].max()  # first token's
            eligible = eligible & (left * best > self.node_cost)
        rank = priority_rank(tree, eligible)
        calls = [eligible & (rank == j) for j in range(self.lad_calls)]
        nodes = [jnp.argmax(m, axis=1).astype(jnp.int32) for m in calls]  # [B] each
        extra = request_tokens(state.prompt, state.out, eos_ids)

        def draft_all():  # [calls, B, K] tokens, and their confidences when calibrated
            out = [self._draft(params["drafter"], tree, cache, state.h1, state.native,
                               state.ctx_h1, state.ctx_native, n, anchor[rows, n], extra,
                               params["out_embedding"], with_confidence=calibrated)
                   for n in nodes]
            return jax.tree.map(lambda *x: jnp.stack(x), *out)

        lad = jax.lax.cond(  # the drafter runs only in steps where a row needs it
            eligible.any(), draft_all,
            lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                 jax.eval_shape(draft_all)))
        if calibrated:  # each chain keeps its first `retained_length` tokens
            lad, confidence = lad
            keep = [retained_length(left[rows, n],
                                    match_probability(cal, self.sampling.temperature, conf),
                                    self.node_cost)
                    for n, conf in zip(nodes, confidence)]
        else:
            keep = [jnp.full((b,), self.K, jnp.int32)] * len(nodes)
        tree, child = tree.spawn(want_anchor, anchor, q_anchor, KIND_ANCHOR)
        lasts = [jnp.where(m.any(1), child[rows, n], -1) for m, n in zip(calls, nodes)]
        for k in range(self.K):  # each call's chain below its anchor, one token per spawn
            want = jnp.zeros((b, c), bool)
            tok = jnp.zeros((b, c), jnp.int32)
            for last, drafted, length in zip(lasts, lad, keep):
                here = ((slots[None] == last[:, None]) & (last >= 0)[:, None]
                        & (k < length)[:, None])
                want = want | here
                tok = jnp.where(here, drafted[:, k:k + 1], tok)
            # sampling: a drafted token is a deterministic proposal, q = one-hot
            q_lad = q_none if greedy else jax.nn.one_hot(tok, tree.q.shape[-1])
            tree, new = tree.spawn(want, tok, q_lad, KIND_LAD)
            lasts = [jnp.where(last >= 0, new[rows, jnp.maximum(last, 0)], -1)
                     for last in lasts]
        return tree

    @staticmethod
    def _children(tree: LoopTree) -> tuple[jax.Array, jax.Array]:
        """Every node's children by kind, in creation order (`KINDS`): slots [B, C, KINDS]
        and whether each exists [B, C, KINDS]. A node has at most one child of each kind."""
        of_kind = tree.children()[:, :, None, :] & (tree.kind[:, None, None, :]
                                         == jnp.asarray(KINDS)[None, None, :, None])
        return jnp.argmax(of_kind, axis=-1).astype(jnp.int32), of_kind.any(-1)

    def _feedback_sampling(self, tree: LoopTree, paused, probs, reads, at_r2, has_kid, key):
        """Sampling feedback for the nodes reads [B, C] (at a readout in [r2, R)): with their
        current distribution in place of the full-depth one, each child's chance of being
        accepted (`draft_chances`, the verification cascade in expectation); at r2 (at_r2)
        the r2 proposal is drawn from what the existing children leave (the cascade's
        residual, so it never repeats a token that would have been accepted) when that chance
        is not zero; every child but the likeliest (the new proposal included) pauses, the
        likeliest (and, with suspend_below < 1, any child given at least that chance)
        resumes. Greedy is the one-hot case of this."""
        b, c = tree.valid.shape
        rows = jnp.arange(b)[:, None, None]
        slot, has = self._children(tree)
        x, q = tree.token[rows, slot], tree.q[rows, slot]  # [B, C, KINDS], [B, C, KINDS, V]
        chance, left, res = draft_chances(probs, q, x, has)  # [B, C, KINDS], [B, C], [B, C, V]
        want = at_r2 & has_kid & (left > 0)
        q_fb = res / jnp.maximum(res.sum(-1, keepdims=True), 1e-30)
        token = jax.random.categorical(key, jnp.log(q_fb), axis=-1).astype(jnp.int32)
        score = jnp.concatenate([jnp.where(has, chance, -1.0),
                                 jnp.where(want, left, -1.0)[..., None]], axis=-1)
        best = jnp.argmax(score, axis=-1)  # [B, C]
        judged = reads[..., None] & has  # [B, C, KINDS]
        favoured = jnp.arange(len(KINDS))[None, None] == best[..., None]

        def slots_of(m):  # [B, C, KINDS] -> the children's slots [B, C]
            return ((slot[..., None] == jnp.arange(c)[None, None, None]) & m[..., None]).any(
                (1, 2))

        # a child the readout gives little chance pauses; the likeliest (and any child given at
        # least `suspend_below`) runs
        runs = favoured | (chance >= self.suspend_below)
        paused = (paused | slots_of(judged & ~runs)) & ~slots_of(judged & runs)
        tree, _ = tree.spawn(want, token, q_fb, KIND_FEEDBACK)
        return tree, paused

    def _draft(self, params, tree: LoopTree, cache: KVCache, h1, native, ctx_h1, ctx_nat,
               node: jax.Array, anchor: jax.Array, extra_ids: jax.Array, out_embedding,
               with_confidence: bool = False):
        """The drafter's K tokens for node [B] over the window of positions ending at it,
        after its anchor [B] (the native proposal; sampling: the drawn one); extra_ids [B, X]
        and out_embedding [E, V] as in `LadDrafter.draft` (with_confidence: also each
        token's confidence [B, K])."""
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
        anchors = anchors.at[:, -1].set(anchor)  # the last window position is the node
        ok = committed | in_tree
        mask = jnp.tril(jnp.ones((w, w), bool))[None] & ok[:, None, :] & ok[:, :, None]
        mask = mask | jnp.eye(w, dtype=bool)[None]
        kw = {"with_confidence": True} if with_confidence else {}
        return self.drafter.draft(params, states.astype(jnp.float32), anchors,
                                  jnp.maximum(want, 0), mask, extra_ids=extra_ids,
                                  out_embedding=out_embedding, **kw)
