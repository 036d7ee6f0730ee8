"""Lookahead parallelism: one step's window columns and candidates split across devices.

Every device holds the whole model, the whole KV cache, the window and the n-gram pool
(replicated over a 1-D mesh, axis `AXIS`). On a two-axis mesh (`lookahead_jax.mesh`:
lookahead x model) "a device" below is a group of `model` devices that holds the model and
cache sharded by tensor parallelism: the shard_map is manual over `AXIS` only, and XLA
partitions each group's forward pass over its model axis. Inside one `jax.shard_map` the whole generation is
one `lax.while_loop`; each step, device d feeds only its share of the step (`ShardedLayout`):

    [pending accepted tokens (N-1 slots) | level 0 (replicated) | its window columns'
     levels 1..N-2 | its candidates]

and the devices then exchange token ids only:
  * one `all_gather` of each device's argmax ids (the current token's next token, its columns'
    newest level, its candidates' predictions): every device then runs the same pool update,
    window slide and greedy verification on identical ids, so their states stay identical;
  * when sampling, one `psum` of (accepted?, token id) per candidate position: the decision
    at each position is taken by the device that holds the logits it needs (the current
    token's: device 0; a candidate's: the device that verified it), with random numbers that
    every device draws identically from the replicated key (`verify.sampling_verdict`).

Keeping the caches consistent. The accepted tokens' K/V exist only on the device that
verified them. Two ways to give every device those K/V: broadcast them (an all-reduce of
L x 2 x (N-1) x Hkv x D activations per step: about 2 MB for Llama-2-7B in bf16 at N=5, 0.18
MB for SmolLM2 in fp32), or re-feed the accepted tokens at the front of the next step, as the
reference does. We re-feed: it costs N-1 more tokens in a step that is memory-bound on an
accelerator (nearly free there; `benchmarks/parallel_bench.py` measures the added step time on
CPU), keeps the collectives at a few hundred bytes of int32 per step, and keeps every
device's cache a function of token ids alone. So each step commits, on every device, the
re-fed tokens of the previous step and the current token; the window's K/V are never kept.

Outputs equal single-device lookahead (and so plain decoding): the verification rule, the
pool and the window are the same; only the K/V of an accepted token come from a different
forward pass (fp32 round-off).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, PartitionSpec

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.generation import Output
from lookahead_jax.lookahead.layout import ShardedLayout
from lookahead_jax.sampling import Sampling
from lookahead_jax.lookahead.step import (LookaheadState, advance_state, lookahead_start,
                                          step_candidates, summarize)
from lookahead_jax.method import First, Method
from lookahead_jax.lookahead.verify import sampling_verdict, verify_greedy
from models.config import ConfigError
from models.kv_cache import KVCache

AXIS = "lookahead"


@struct.dataclass
class ParallelState:
    inner: LookaheadState  # replicated: identical on every device
    pending: jax.Array  # [B, N-1] tokens accepted last step, K/V not yet in the cache
    pending_count: jax.Array  # [B] int32, how many of them are real

    @property
    def out(self) -> Output:
        return self.inner.out

    @property
    def steps(self) -> jax.Array:
        return self.inner.steps


def lookahead_mesh(devices: int) -> Mesh:
    """A 1-D mesh over the first `devices` local devices."""
    found = jax.local_devices()
    if not 1 <= devices <= len(found):
        hint = (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N creates N devices)"
                if found[0].platform == "cpu" else "")
        raise ConfigError(f"lookahead parallelism: {devices} devices asked for, "
                          f"{len(found)} available{hint}")
    return Mesh(np.array(found[:devices]), (AXIS,))


def _local_mask(cache: KVCache, pending_count: jax.Array, n1: int, share: jax.Array) -> jax.Array:
    """[B, P+T, S+P+T] bool over [cache slots | pending block | this device's share], P = n1:
    pending tokens are causal among themselves and seen by the whole share; pending slots past
    `pending_count` [B] are seen by nobody but themselves; `share` [T, T] is the share's own
    visibility."""
    t = share.shape[0]
    i = jnp.arange(n1)
    top = jnp.concatenate([i[None, :] <= i[:, None], jnp.zeros((n1, t), bool)], axis=1)
    bottom = jnp.concatenate([jnp.ones((t, n1), bool), share], axis=1)
    local = jnp.concatenate([top, bottom], axis=0)  # [P+T, P+T]
    col = jnp.arange(n1 + t)
    real = (col[None, :] >= n1) | (col[None, :] < pending_count[:, None])  # [B, P+T]
    local = local[None] & (real[:, None, :] | jnp.eye(n1 + t, dtype=bool)[None])
    b = pending_count.shape[0]
    committed = jnp.broadcast_to(cache.visible()[:, None, :], (b, n1 + t, cache.max_len))
    return jnp.concatenate([committed, local], axis=-1)


def parallel_step(model: nnx.Module, st: ParallelState, *, cfg: LookaheadConfig, devices: int,
                  sampling: Sampling, eos_ids: tuple[int, ...],
                  verifier: Callable = sampling_verdict) -> ParallelState:
    """One lookahead step on this device's share; called inside `shard_map` over `AXIS`.
    `verifier` decides the tokens when sampling (`verify.sampling_verdict`'s signature)."""
    lay = ShardedLayout(cfg.W, cfg.N, cfg.G, devices)
    d = jax.lax.axis_index(AXIS)

    def mine(name):  # this device's row of a stacked ShardedLayout table
        return jnp.asarray(lay.tables[name])[d]

    state = st.inner
    cache = state.cache
    b = state.token.shape[0]
    n1 = cfg.N - 1
    live = ~state.out.done

    grid = state.window.with_current(state.token)  # [B, N-1, W]
    padded = jnp.pad(grid, ((0, 0), (0, 0), (0, lay.W_pad - cfg.W)))
    cands, cand_valid = step_candidates(state, cfg)  # replicated: [B, G, N-1], [B, G]
    cands_pad = jnp.pad(cands, ((0, 0), (0, lay.G_pad - cfg.G), (0, 0)))
    own = jax.lax.dynamic_slice_in_dim(cands_pad, d * lay.G_d, lay.G_d, axis=1)
    tokens = jnp.concatenate([st.pending, padded.reshape(b, -1)[:, mine("window_src")],
                              own.reshape(b, -1)], axis=1)  # [B, P+T]
    positions = jnp.concatenate(
        [cache.length[:, None] + jnp.arange(n1)[None, :],
         (cache.length + st.pending_count)[:, None] + mine("offsets")[None, :]], axis=1)
    mask = _local_mask(cache, st.pending_count, n1, mine("mask"))
    newest = jax.lax.dynamic_index_in_dim(mine("newest"), state.window.filled - 1, axis=0,
                                          keepdims=False)  # [W_d]
    readout = n1 + jnp.concatenate([jnp.zeros((1,), jnp.int32), newest,
                                    mine("candidates").reshape(-1)])
    logits, new_kv = model(tokens, positions, mask, cache,
                           logits_at=jnp.broadcast_to(readout[None], (b, readout.shape[0])))
    preds = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, 1 + W_d + G_d(N-1)]

    # the one exchange every step: every device's argmax ids
    ids = jax.lax.all_gather(preds, AXIS)  # [D, B, 1 + W_d + G_d(N-1)]
    next0 = ids[0, :, 0]
    new_level = ids[:, :, 1: 1 + lay.W_d].transpose(1, 0, 2).reshape(b, lay.W_pad)[:, :cfg.W]
    cand_preds = (ids[:, :, 1 + lay.W_d:].reshape(devices, b, lay.G_d, n1)
                  .transpose(1, 0, 2, 3).reshape(b, lay.G_pad, n1)[:, :cfg.G])

    key = state.key
    if sampling.greedy:
        verdict = verify_greedy(next0, cand_preds, cands, cand_valid)
    else:
        key, sub = jax.random.split(key)
        rows = jnp.arange(b)
        own_logits = logits[:, 1 + lay.W_d:].reshape(b, lay.G_d, n1, logits.shape[-1])

        def logits_at(j, rep):
            if j == 0 or lay.G_d == 0:
                return logits[:, 0]
            return own_logits[rows, jnp.clip(rep - d * lay.G_d, 0, lay.G_d - 1), j - 1]

        def agree(j, rep, decision):  # the decision of the device that held those logits
            owner = jnp.zeros_like(rep) if j == 0 or lay.G_d == 0 else rep // lay.G_d
            took, token = decision
            keep = owner == d
            took = jax.lax.psum(jnp.where(keep, took.astype(jnp.int32), 0), AXIS) > 0
            return took, jax.lax.psum(jnp.where(keep, token, 0), AXIS)

        verdict = verifier(sub, sampling, logits_at, cands, cand_valid, agree)

    # commit the re-fed tokens and the current token; re-feed this step's accepted ones next
    k = st.pending_count
    slot = jnp.arange(n1 + 1)[None, :]
    src = jnp.where(slot < k[:, None], slot, n1)  # pending 0..k-1, then the current token
    cache = cache.append(new_kv, src, jnp.where(live, k + 1, 0))
    inner = advance_state(state, cfg=cfg, eos_ids=eos_ids, grid=grid, new_level=new_level,
                          cand_valid=cand_valid, verdict=verdict, cache=cache, key=key)
    return ParallelState(inner, verdict.tokens[:, :n1], jnp.where(live, verdict.accepted, 0))


@dataclasses.dataclass(frozen=True)
class ParallelLookahead(Method):
    """Lookahead decoding with lookahead parallelism over `devices` local devices
    (`--method=lookahead --devices=N`). Dense attention only. verifier: the sampling
    procedure, `verify.sampling_verdict` or one of its signature (tests plant wrong ones)."""

    config: LookaheadConfig = LookaheadConfig()
    devices: int = 2
    mesh: Mesh | None = None  # a (lookahead, model) mesh (`lookahead_jax.mesh`); None: 1-D
    verifier: Callable = sampling_verdict

    name = "lookahead"

    def __post_init__(self):
        super().__post_init__()
        if self.mesh is None:
            lookahead_mesh(self.devices)  # fails here if there are not enough devices
        elif self.mesh.shape.get(AXIS, 1) != self.devices:
            raise ConfigError(f"lookahead parallelism over {self.devices} devices, but the "
                              f"mesh's {AXIS} axis has {self.mesh.shape.get(AXIS, 1)}")

    def cache_capacity(self, model_config) -> int:
        return self.config.N  # the re-fed tokens and the current token

    def check(self, model_config) -> None:
        self.config.check_fits(model_config.max_position_embeddings)

    def start(self, model, params, first: First) -> ParallelState:
        inner = lookahead_start(first, self.config, model.config.vocab_size)
        b = first.tokens.shape[0]
        return ParallelState(inner, jnp.zeros((b, self.config.N - 1), jnp.int32),
                             jnp.zeros((b,), jnp.int32))

    def step(self, model, params, state: ParallelState, *, eos_ids) -> ParallelState:
        return parallel_step(model, state, cfg=self.config, devices=self.devices,
                             sampling=self.sampling, eos_ids=eos_ids, verifier=self.verifier)

    def run(self, graphdef, params, state, max_steps, *, eos_ids):
        """Up to `max_steps` steps on `devices` devices: one shard_map around the base class's
        while_loop, manual over the lookahead axis only. Parameters and state are replicated
        over it; only the step's tokens are split. On a two-axis mesh the model axis stays
        automatic: the parameters' and cache's shardings over it (tensor parallelism) carry
        into the body and XLA partitions each group's forward pass over its model devices."""
        body = functools.partial(Method.run, self, graphdef, eos_ids=eos_ids)
        rep = PartitionSpec()
        mesh = lookahead_mesh(self.devices) if self.mesh is None else self.mesh
        return jax.shard_map(body, mesh=mesh, in_specs=(rep, rep, rep), out_specs=rep,
                             axis_names={AXIS}, check_vma=False)(params, state, max_steps)

    def summary(self, state: ParallelState) -> dict:
        lay = ShardedLayout(self.config.W, self.config.N, self.config.G, self.devices)
        return {**summarize(self.config, state.inner), "devices": self.devices,
                "tokens_per_device": lay.size + self.config.N - 1}
