"""The candidate tree of a looped model: tokens held at different loop depths, on device.

LoopSpec and LoopAhead both keep a small tree of speculative tokens per batch row. Its root is
the oldest token that is known to be right (it was emitted) but has not yet run all R loops;
every other node is a drafted future token, a child one position after its parent. Each node
carries its own state h at its own loop depth (0..R), the prelude output e, and the draft
distribution it was drawn from (for sampling verification).

Fixed capacity C per row (static shapes), all fields `[B, C, ...]`:

- `valid`: the slot holds a live node; `fresh`: created, not yet embedded (no h / e yet).
- `token`, `pos` (absolute position), `depth` (loops done), `parent` (-1: none), `kind`
  (which proposal made the node: 0 the root, 1 the first draft, 2 a second draft, ...).
- `anc[b, i, j]`: node j is a strict ancestor of node i (the attention mask inside the tree).
- `root [B]`: the slot of the root.

K/V of speculative tokens: node i's K/V, at every depth it has run (each loop, Raven's prelude
and coda readouts), lives in a per-row *scratch* position of the ordinary per-depth cache:
position `S - C + i` of cache length S (`scratch_positions`). A node attends, at its own depth,
to the committed positions `< cache.length` and to its ancestors' scratch positions, never to
siblings or other branches; its RoPE position is its true position `pos`. When the root has
run all R loops and the full-depth readout has verified its child, the root is committed:
its K/V at every cache slot is copied from its scratch position to position `cache.length`
(`commit_root`), and `length` grows by one. A pruned node's scratch position is simply reused;
a node's descendants read its depth-k K/V only after it wrote it (a parent is always deeper
than its child), so stale K/V is never read.

`prefill_all_depths` is the prefill for these methods: besides every loop's K/V it writes
Raven's coda K/V at the readout depths the method reads (plain prefill writes depth R only).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from models.kv_cache import KVCache, NewKV
from models.layers import causal_mask


@struct.dataclass
class LoopTree:
    """Per-row candidate trees of capacity C (see the module docstring)."""

    valid: jax.Array  # [B, C] bool
    fresh: jax.Array  # [B, C] bool, not yet embedded
    token: jax.Array  # [B, C] int32
    pos: jax.Array  # [B, C] int32, absolute position
    depth: jax.Array  # [B, C] int32, loops done (0..R)
    parent: jax.Array  # [B, C] int32, -1 for none
    kind: jax.Array  # [B, C] int32, the proposal that made the node (0: root)
    anc: jax.Array  # [B, C, C] bool, anc[b, i, j]: j is a strict ancestor of i
    h: jax.Array  # [B, C, E] state at `depth`
    e: jax.Array  # [B, C, E] prelude output (ouro: the embedding)
    q: jax.Array  # [B, C, Vq] float32, the distribution `token` was drawn from (Vq = 1: greedy)
    root: jax.Array  # [B] int32

    @classmethod
    def init(cls, token: jax.Array, pos: jax.Array, capacity: int, hidden: int, dtype,
             q_size: int) -> "LoopTree":
        """One fresh root per row: token [B] at position pos [B], in slot 0."""
        b, c = token.shape[0], capacity
        slot0 = jnp.arange(c)[None, :] == 0
        return cls(
            valid=jnp.broadcast_to(slot0, (b, c)), fresh=jnp.broadcast_to(slot0, (b, c)),
            token=jnp.zeros((b, c), jnp.int32).at[:, 0].set(token),
            pos=jnp.zeros((b, c), jnp.int32).at[:, 0].set(pos),
            depth=jnp.zeros((b, c), jnp.int32), parent=jnp.full((b, c), -1, jnp.int32),
            kind=jnp.zeros((b, c), jnp.int32),
            anc=jnp.zeros((b, c, c), bool), h=jnp.zeros((b, c, hidden), dtype),
            e=jnp.zeros((b, c, hidden), dtype), q=jnp.zeros((b, c, q_size), jnp.float32),
            root=jnp.zeros((b,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def scratch_positions(self, cache: KVCache) -> jax.Array:
        """[C] the cache position holding node i's K/V: S - C + i."""
        return cache.max_len - self.capacity + jnp.arange(self.capacity, dtype=jnp.int32)

    def attention_mask(self, cache: KVCache, depth: jax.Array) -> jax.Array:
        """[B, C, S + C] for a call where node i works at depth[b, i] ([B, C]): it sees the
        committed positions and, among its ancestors, the deeper ones' scratch positions
        (their K/V at i's depth is already in the cache) and the ones at its own depth as new
        tokens of the same call (their K/V at that depth is computed in this call), and
        itself. (The model further keeps a new token's view of the others to equal depths.)"""
        b, c = self.valid.shape
        s = cache.max_len
        d_self, d_anc = depth[:, :, None], depth[:, None, :]
        committed = jnp.broadcast_to(cache.visible()[:, None, :], (b, c, s))
        old = committed.at[:, :, s - c:].set(self.anc & (d_anc > d_self))
        new = (self.anc & (d_anc == d_self)) | jnp.eye(c, dtype=bool)[None]
        return jnp.concatenate([old, new], axis=-1)

    def children(self) -> jax.Array:
        """[B, C, C] kids[b, i, j]: node j is a live child of node i."""
        slots = jnp.arange(self.capacity)
        return self.valid[:, None, :] & (self.parent[:, None, :] == slots[None, :, None])

    def free(self, drop: jax.Array) -> "LoopTree":
        """Removes the nodes where drop [B, C]; clears them from every ancestor set so their
        slots can be reused."""
        return self.replace(valid=self.valid & ~drop, fresh=self.fresh & ~drop,
                            anc=self.anc & ~drop[:, None, :])

    def keep_subtree(self, rows: jax.Array, new_root: jax.Array) -> "LoopTree":
        """In rows [B]: new_root [B] becomes the root; everything outside its subtree (the old
        root included) is freed."""
        is_root = jnp.arange(self.capacity)[None, :] == new_root[:, None]
        drop = rows[:, None] & ~self.subtree(new_root)
        tree = self.free(drop)
        at_root = rows[:, None] & is_root
        return tree.replace(root=jnp.where(rows, new_root, tree.root),
                            parent=jnp.where(at_root, -1, tree.parent),
                            kind=jnp.where(at_root, 0, tree.kind))

    def subtree(self, new_root: jax.Array) -> jax.Array:
        """[B, C] the node new_root [B] and its descendants."""
        is_root = jnp.arange(self.capacity)[None, :] == new_root[:, None]
        return is_root | jnp.take_along_axis(self.anc, new_root[:, None, None], axis=2)[:, :, 0]

    def discarded(self, keep: jax.Array, new_root: jax.Array, restart: jax.Array) -> jax.Array:
        """[B, C] the nodes a verification throws away, the committed root not counted: in
        rows keep [B] (`keep_subtree` to new_root [B]) everything outside new_root's subtree,
        in rows restart [B] (`restart`) every node."""
        slots = jnp.arange(self.capacity)[None, :]
        lost = (keep[:, None] & ~self.subtree(new_root)) | restart[:, None]
        return self.valid & lost & (slots != self.root[:, None])

    def restart(self, rows: jax.Array, token: jax.Array, pos: jax.Array) -> "LoopTree":
        """In rows [B]: every node freed; a fresh root token [B] at position pos [B] in slot 0."""
        fresh = LoopTree.init(token, pos, self.capacity, self.h.shape[-1], self.h.dtype,
                              self.q.shape[-1])
        pick = lambda new, old: jnp.where(  # noqa: E731
            rows.reshape(-1, *([1] * (old.ndim - 1))), new, old)
        return jax.tree.map(pick, fresh, self)

    def spawn(self, want: jax.Array, token: jax.Array, q: jax.Array, kind: jax.Array | int = 1
              ) -> tuple["LoopTree", jax.Array]:
        """Every node i with want[b, i] gets a child holding token[b, i] (drawn from q[b, i],
        [B, C, Vq]; made by proposal kind[b, i]) at depth 0, position pos + 1, in a free slot
        (the k-th requester of a row takes its k-th free slot; requests beyond the free slots
        are dropped).
        Returns the tree and, per requester, the slot of its new child [B, C] (-1: none)."""
        c = self.capacity
        free = ~self.valid
        want_rank = jnp.cumsum(want, axis=1) - 1  # [B, C]
        free_rank = jnp.cumsum(free, axis=1) - 1
        # assign[b, i, j]: requester i takes free slot j
        assign = (want[:, :, None] & free[:, None, :]
                  & (want_rank[:, :, None] == free_rank[:, None, :]))
        child = jnp.where(assign.any(2), jnp.argmax(assign, axis=2), -1).astype(jnp.int32)
        filled = assign.any(1)  # [B, C] slots receiving a child
        parent = jnp.argmax(assign, axis=1).astype(jnp.int32)  # [B, C], for filled slots

        def from_parent(x):
            return jnp.take_along_axis(x, parent.reshape(*parent.shape, *([1] * (x.ndim - 2))),
                                       axis=1)

        anc = from_parent(self.anc) | (jnp.arange(c)[None, None, :] == parent[:, :, None])
        f = filled
        tree = self.replace(
            valid=self.valid | f, fresh=self.fresh | f,
            token=jnp.where(f, from_parent(token), self.token),
            pos=jnp.where(f, from_parent(self.pos) + 1, self.pos),
            depth=jnp.where(f, 0, self.depth),
            parent=jnp.where(f, parent, self.parent),
            kind=jnp.where(f, from_parent(jnp.broadcast_to(kind, want.shape)), self.kind),
            anc=jnp.where(f[:, :, None], anc, self.anc),
            q=jnp.where(f[:, :, None], from_parent(q), self.q))
        return tree, child


def commit_root(cache: KVCache, tree: LoopTree, rows: jax.Array) -> KVCache:
    """In rows [B], copies the root's K/V (every cache slot) from its scratch position to
    position cache.length (= the root's position) and extends length by one."""
    b = cache.batch
    src = tree.scratch_positions(cache)[tree.root]  # [B]
    dst = jnp.where(rows, cache.length, cache.max_len)
    r = jnp.arange(b)
    k = cache.k.at[:, r, :, dst].set(cache.k[:, r, :, src], mode="drop")
    v = cache.v.at[:, r, :, dst].set(cache.v[:, r, :, src], mode="drop")
    return cache.replace(k=k, v=v, length=cache.length + rows.astype(jnp.int32))


def prefill_all_depths(model, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
                       readout_depths: Sequence[int], keep_depth: int = 0):
    """The padded prompts [B, P] through all R loops into an empty cache: the prelude's and
    every loop's K/V, and (Raven) the coda's K/V at each of `readout_depths` (1..R; the others
    stay zero: never read). Returns the full-depth logits at each row's last prompt token
    [B, V] and the cache with length = lengths; with keep_depth > 0 also every prompt token's
    state at that depth [B, P, E] and the argmax of its readout there [B, P] (its native
    proposal for the next token)."""
    cfg = model.config
    b, p = tokens.shape
    r_full = cfg.num_loops
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
    mask = causal_mask(lengths, p, cache)
    last = (lengths - 1).astype(jnp.int32)[:, None]
    pre_kv, states = model.loop_states(tokens, positions, mask, cache)
    loop_kv, coda_kv = [], {}
    logits = None
    for r, (h, kv) in enumerate(states):
        loop_kv.append(kv)
        if r + 1 == keep_depth:
            kept = h
            native = jnp.argmax(model.readout(h, r + 1, positions, mask, cache)[0],
                                axis=-1).astype(jnp.int32)
        if r + 1 == r_full or (cfg.coda_layers and r + 1 in readout_depths):
            lg, ckv = model.readout(h, r + 1, positions, mask, cache, logits_at=last)
            if ckv is not None:
                coda_kv[r + 1] = ckv
            if r + 1 == r_full:
                logits = lg[:, 0]
    parts = ([pre_kv] if pre_kv is not None else []) + loop_kv
    if cfg.coda_layers:
        template = coda_kv[r_full]
        for d in range(1, r_full + 1):
            parts.append(coda_kv.get(d, NewKV(jnp.zeros_like(template.k),
                                              jnp.zeros_like(template.v))))
    new = NewKV(jnp.concatenate([kv.k for kv in parts]), jnp.concatenate([kv.v for kv in parts]))
    src = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
    cache = cache.write(new, src, src).replace(length=lengths.astype(jnp.int32))
    if keep_depth:
        return logits, cache, kept, native
    return logits, cache


def loop_advance(model, tree: LoopTree, cache: KVCache, live: jax.Array,
                 readout_depths: Sequence[int], run: jax.Array | None = None
                 ) -> tuple[LoopTree, KVCache, jax.Array, jax.Array]:
    """One batched call of the shared block over the tree: embeds fresh nodes (Raven: the
    prelude, its K/V kept), advances every node of a live row below depth R (and in `run`
    [B, C], when given: the scheduler's choice) by one loop, each at its own depth, committing
    its K/V at its scratch position, and reads every node out at its new depth (Raven: coda
    K/V kept at `readout_depths`). Nodes of one branch at equal depths see each other inside
    the call. Returns the tree, cache, logits [B, C, V] and the advanced nodes [B, C]."""
    r_full = model.config.num_loops
    c = tree.capacity
    b = tree.valid.shape[0]
    scratch = tree.scratch_positions(cache)[None]
    s = cache.max_len
    src = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32)[None], (b, c))
    # embed fresh nodes (ouro: a lookup; raven: the prelude over the fresh ancestors too)
    fresh = tree.fresh & tree.valid & live[:, None]
    embed_mask = tree.attention_mask(cache, (~tree.fresh).astype(jnp.int32))
    e_new, pre_kv = model.embed(tree.token, tree.pos, embed_mask, cache)
    if pre_kv is not None:
        cache = model.write_prelude_kv(cache, pre_kv, src, jnp.where(fresh, scratch, s))
    h0 = model.initial_state(e_new, tree.pos)
    e = jnp.where(fresh[..., None], e_new, tree.e)
    h = jnp.where(fresh[..., None], h0, tree.h)
    # one loop for the chosen nodes below full depth
    active = tree.valid & (tree.depth < r_full) & live[:, None]
    if run is not None:
        active = active & run
    d_in = jnp.minimum(tree.depth, r_full - 1)
    h_next, kv = model.advance(h, e, d_in, tree.pos, tree.attention_mask(cache, d_in), cache)
    cache = model.write_loop_kv(cache, kv, d_in, src, jnp.where(active, scratch, s))
    h = jnp.where(active[..., None], h_next, h)
    depth = tree.depth + active.astype(jnp.int32)
    # readout at each node's new depth
    d_out = jnp.clip(depth, 1, r_full)
    logits, coda_kv = model.readout(h, d_out, tree.pos, tree.attention_mask(cache, d_out), cache)
    if coda_kv is not None:
        at = active & jnp.isin(d_out, jnp.asarray(tuple(readout_depths), jnp.int32))
        cache = model.write_coda_kv(cache, coda_kv, d_out, src, jnp.where(at, scratch, s))
    tree = tree.replace(h=h, e=e, depth=depth, fresh=tree.fresh & ~fresh)
    return tree, cache, logits, active
