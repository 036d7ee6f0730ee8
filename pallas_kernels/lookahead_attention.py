"""Block-sparse attention for one lookahead step, in Pallas: Triton on GPU, Mosaic on TPU.

Queries: the step's T tokens. Keys/values: the cache (row b valid up to cache_len[b]) and the
step's T tokens, two separate inputs: the cache is read in place, never joined to the step.
Visibility: a `StepMask` (cache lengths + the step's `StepLayout`),
tiled by a `BlockMap`. Flash-attention style: an online softmax across key tiles, accumulated
in float32 whatever the input dtype (float32 or bfloat16); a query row with no visible key
returns zeros, as the dense reference does.

Layout inside the kernel (built by `lookahead_attention`, undone on the way out):
  q     [B, Hkv, R, D]     R = T * group rows per K/V head (row r = token r // group), padded
                           to a multiple of block_q: one query tile serves every head of a group
  cache k, v [B, Hkv, S', D]  the cache as the model holds it (head-major); S' = S when S is
                           a multiple of block_k (the engine allocates whole 128-slot blocks),
                           else a zero-padded copy
  step k, v  [B, Hkv, T', D]  the step's K/V, zero-padded to T', a multiple of block_k
  mask  [R', T'] int32     the layout's mask, one row per query row (`BlockMap.row_mask`)

Which tiles are computed:
  GPU  grid (B, Hkv, query blocks). Each program loops over its row's cache blocks
       [0, cdiv(cache_len[b], block_k)) (a dynamic trip count) and then over the step blocks
       listed for its query block (`BlockMap.step_index`): skipped tiles cost nothing.
  TPU  grid (B, Hkv, query blocks, key blocks), cache lengths and the tile tables in SMEM
       (scalar prefetch). A skipped tile runs no compute (`pl.when`) and its K/V index map
       repeats the previous block, so the pipeline issues no copy for it either.

Both run under the Pallas interpreter (`interpret=True`), on any platform; compiled, each needs
its platform and raises `KernelUnavailable` elsewhere. The platform a compiled kernel is for is
jax's default backend unless given (`platform=`): naming another one ('cuda', 'tpu') on a host
without it only makes sense to lower the kernel for that platform (`jax.export`), not to run it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from models.layers import dot_product_attention
from pallas_kernels.platform import KERNEL_BACKENDS, KernelUnavailable
from pallas_kernels.block_map import BlockMap, cdiv
from lookahead_jax.lookahead.mask import StepMask

BACKENDS = ("triton", "mosaic_tpu")
# kernel backend -> the jax platform names it compiles for ('gpu' is jax's default backend on an
# NVIDIA or AMD GPU; 'cuda' and 'rocm' are the names `jax.export` lowers for)
PLATFORM_OF = {b: tuple(p for p, kb in KERNEL_BACKENDS.items() if kb == b) for b in BACKENDS}
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf
LANES = 128  # TPU lane width: m and l are kept replicated across one lane tile


def check_platform(backend: str, platform: str | None = None) -> None:
    """Raises `KernelUnavailable` unless the compiled `backend` kernel is for `platform`
    (default: jax's default backend)."""
    platform = platform or jax.default_backend()
    if platform not in PLATFORM_OF[backend]:
        raise KernelUnavailable(
            f"the {backend} lookahead attention kernel needs platform "
            f"{'/'.join(PLATFORM_OF[backend])}, this is {platform!r}: use the dense attention, "
            f"or interpret=True")


def default_blocks(backend: str, rows: int) -> tuple[int, int]:
    """(block_q, block_k) for `rows` = T * group query rows."""
    if backend == "mosaic_tpu":  # sublane-aligned query tiles, lane-wide key tiles
        return min(128, cdiv(rows, 16) * 16), 128
    # Triton: power-of-two tiles of at least 16 (tl.dot); small query tiles give more programs
    return min(32, max(16, pl.next_power_of_2(rows))), 32


def _check_blocks(backend: str, block_q: int, block_k: int, head_dim: int) -> None:
    if backend == "triton":
        for name, n in (("block_q", block_q), ("block_k", block_k)):
            if n < 16 or n & (n - 1):
                raise ValueError(f"Triton: {name} must be a power of two >= 16, got {n}")
    elif backend == "mosaic_tpu":
        if block_q % 8 or block_k % LANES:
            raise ValueError(f"TPU: block_q must be a multiple of 8 and block_k of {LANES}, "
                             f"got {block_q}, {block_k}")
    else:
        raise ValueError(f"unknown kernel backend {backend!r}: expected one of {BACKENDS}")


def _online_update(carry, q, k, v, visible, *, scale: float, precision):
    """One key tile of the online softmax. carry: m [bq], l [bq], acc [bq, D] float32;
    q [bq, D], k/v [bk, D], visible [bq, bk] (or broadcastable) bool."""
    m, l, acc = carry
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = l * corr + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return m_new, l_new, acc * corr[:, None] + pv


# -- GPU: Triton ---------------------------------------------------------------------------------
def _triton_kernel(len_ref, count_ref, index_ref, q_ref, ck_ref, cv_ref, sk_ref, sv_ref, mask_ref,
                   o_ref, *, block_k: int, scale: float, precision):
    bq, d = q_ref.shape
    q = q_ref[...]
    cache_len = len_ref[0]
    update = functools.partial(_online_update, scale=scale, precision=precision)
    carry = (jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32),
             jnp.zeros((bq, d), jnp.float32))

    def cache_tile(c, carry):
        start = pl.multiple_of(c * block_k, block_k)
        visible = (start + jnp.arange(block_k))[None, :] < cache_len
        return update(carry, q, ck_ref[pl.ds(start, block_k), :],
                      cv_ref[pl.ds(start, block_k), :], visible)

    carry = lax.fori_loop(0, lax.div(cache_len + (block_k - 1), block_k), cache_tile, carry)

    def step_tile(j, carry):
        s = index_ref[j]
        col = pl.multiple_of(s * block_k, block_k)
        visible = mask_ref[:, pl.ds(col, block_k)] != 0
        return update(carry, q, sk_ref[pl.ds(col, block_k), :], sv_ref[pl.ds(col, block_k), :],
                      visible)

    m, l, acc = lax.fori_loop(0, count_ref[0], step_tile, carry)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def _triton_call(q, ck, cv, sk, sv, cache_len, bmap: BlockMap, *, scale, precision,
                 interpret: bool):
    """q [B, Hkv, R', D], cache ck/cv [B, Hkv, S', D], step sk/sv [B, Hkv, T', D], cache_len [B]
    -> [B, Hkv, R', D]."""
    from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415

    b, hkv, _, d = q.shape
    bq, bk = bmap.block_q, bmap.block_k
    index, count = bmap.step_index
    kernel = functools.partial(_triton_kernel, block_k=bk, scale=scale, precision=precision)
    cache_spec = pl.BlockSpec((None, None, ck.shape[2], d), lambda b_, h, i: (b_, h, 0, 0))
    step_spec = pl.BlockSpec((None, None, sk.shape[2], d), lambda b_, h, i: (b_, h, 0, 0))
    tile_spec = pl.BlockSpec((None, None, bq, d), lambda b_, h, i: (b_, h, i, 0))
    return pl.pallas_call(
        kernel,
        grid=(b, hkv, bmap.q_blocks),
        in_specs=[
            pl.BlockSpec((1,), lambda b_, h, i: (b_,)),  # cache_len
            pl.BlockSpec((1,), lambda b_, h, i: (i,)),  # step tiles to compute
            pl.BlockSpec((None, index.shape[1]), lambda b_, h, i: (i, 0)),  # which
            tile_spec, cache_spec, cache_spec, step_spec, step_spec,
            pl.BlockSpec((bq, bmap.step_padded), lambda b_, h, i: (i, 0)),  # row mask
        ],
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="lookahead_attention_triton",
    )(cache_len, jnp.asarray(count), jnp.asarray(index), q, ck, cv, sk, sv,
      jnp.asarray(bmap.row_mask, jnp.int32))


# -- TPU: Mosaic -----------------------------------------------------------------------------------
def _tpu_kernel(len_ref, vis_ref, fetch_ref, q_ref, ck_ref, cv_ref, sk_ref, sv_ref, mask_ref,
                o_ref, m_ref, l_ref, acc_ref, *, cache_blocks: int, step_blocks: int,
                block_k: int, scale: float, precision):
    del fetch_ref  # used by the index maps only
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    bq, d = acc_ref.shape

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    cache_len = len_ref[b]
    in_cache = j < cache_blocks
    s = jnp.maximum(j - cache_blocks, 0)
    tile_visible = jnp.where(in_cache, j * block_k < cache_len,
                             vis_ref[i * step_blocks + s] != 0)

    def compute(k_ref, v_ref, visible):
        m_prev, l_prev = m_ref[...], l_ref[...]  # [bq, LANES], replicated across lanes
        sc = lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32) * scale
        sc = jnp.where(visible, sc, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(sc - jnp.tile(m_next, (1, block_k // LANES))), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        acc_ref[...] = _lanes_to(alpha, d) * acc_ref[...] + pv

    @pl.when(tile_visible & in_cache)
    def _cache_tile():
        cols = j * block_k + lax.broadcasted_iota(jnp.int32, (bq, block_k), 1)
        compute(ck_ref, cv_ref, cols < cache_len)

    @pl.when(tile_visible & ~in_cache)
    def _step_tile():
        compute(sk_ref, sv_ref, mask_ref[...] != 0)

    @pl.when(j == cache_blocks + step_blocks - 1)
    def _finish():
        l = l_ref[...]
        inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
        o_ref[...] = (acc_ref[...] * _lanes_to(inv, d)).astype(o_ref.dtype)


def _lanes_to(x, d: int):
    """[bq, LANES] lane-replicated -> [bq, d]."""
    return jnp.tile(x, (1, cdiv(d, LANES)))[:, :d]


def _tpu_call(q, ck, cv, sk, sv, cache_len, bmap: BlockMap, *, scale, precision,
              interpret: bool):
    """q [B, Hkv, R', D], cache ck/cv [B, Hkv, S', D], step sk/sv [B, Hkv, T', D], cache_len [B]
    -> [B, Hkv, R', D]."""
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415

    b, hkv, _, d = q.shape
    bq, bk = bmap.block_q, bmap.block_k
    nc, nt = ck.shape[2] // bk, bmap.step_blocks
    kernel = functools.partial(_tpu_kernel, cache_blocks=nc, step_blocks=nt, block_k=bk,
                               scale=scale, precision=precision)

    # The block each input holds at tile j. A tile that computes nothing holds the block already
    # in memory, so the pipeline copies nothing for it: the cache holds its last visible block
    # through the step tiles, the step holds its first fetched block through the cache tiles.
    def cache_map(b_, h, i, j, len_ref, vis_ref, fetch_ref):
        last_cache = jnp.maximum(lax.div(len_ref[b_] + (bk - 1), bk) - 1, 0)
        return b_, h, jnp.minimum(j, last_cache), 0

    def step_block(i, j, fetch_ref):
        return jnp.maximum(fetch_ref[i * nt + jnp.maximum(j - nc, 0)], 0)

    def step_map(b_, h, i, j, len_ref, vis_ref, fetch_ref):
        return b_, h, step_block(i, j, fetch_ref), 0

    def mask_map(b_, h, i, j, len_ref, vis_ref, fetch_ref):
        return i, step_block(i, j, fetch_ref)

    tile_spec = pl.BlockSpec((None, None, bq, d), lambda b_, h, i, j, *_: (b_, h, i, 0))
    cache_spec = pl.BlockSpec((None, None, bk, d), cache_map)
    step_spec = pl.BlockSpec((None, None, bk, d), step_map)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, hkv, bmap.q_blocks, nc + nt),
        in_specs=[tile_spec, cache_spec, cache_spec, step_spec, step_spec,
                  pl.BlockSpec((bq, bk), mask_map)],
        out_specs=tile_spec,
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),
                        pltpu.VMEM((bq, LANES), jnp.float32),
                        pltpu.VMEM((bq, d), jnp.float32)])
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="lookahead_attention_tpu",
    )(cache_len, jnp.asarray(bmap.tiles.reshape(-1), jnp.int32),
      jnp.asarray(bmap.step_fetch.reshape(-1)), q, ck, cv, sk, sv,
      jnp.asarray(bmap.row_mask, jnp.int32))


# -- the entry point -----------------------------------------------------------------------------
def _pad_axis(x, axis: int, size: int):
    """x zero-padded along `axis` to `size` (no copy when it already has that size)."""
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def lookahead_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: StepMask,
                        cache_k: jax.Array, cache_v: jax.Array, *,
                        backend: str = "triton", interpret=False,
                        block_q: int | None = None, block_k: int | None = None,
                        platform: str | None = None, scale: float | None = None) -> jax.Array:
    """Attention of one lookahead step, computing only tiles with a visible key.

    q [B,T,H,D]; k/v [B,T,Hkv,D] the step's K/V; cache_k/v [B,Hkv,S,D] one cache layer
    (head-major, as `models.kv_cache.KVCache` holds it); mask a `StepMask` (cache lengths [B],
    the step's layout, S). Returns [B,T,H,D] in q's dtype. The cache is passed to the kernel as
    it lies (no copy when S is a multiple of block_k, which the engine's 128-slot caches are).
    backend: 'triton' (GPU) or 'mosaic_tpu' (TPU). interpret: run in the Pallas interpreter
    (True; or, for the TPU kernel, `pltpu.InterpretParams(...)`: the TPU interpreter).
    block_q counts query rows (token x head of a K/V group), block_k keys.
    platform: the jax platform the compiled kernel is for (default: jax's default backend);
    another one ('cuda', 'tpu') only to lower for it, e.g. `jax.export(..., platforms=[...])`
    on a host without it. Compiled, a kernel off its platform raises `KernelUnavailable`;
    interpreted, the platform is not used. scale: the score scale (default D ** -0.5; Gemma's
    query_pre_attn_scalar ** -0.5).
    """
    if not isinstance(mask, StepMask):
        raise TypeError(f"lookahead_attention needs a StepMask, got {type(mask).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}: expected one of {BACKENDS}")
    if not interpret:
        check_platform(backend, platform)
    b, t, h, d = q.shape
    hkv = k.shape[2]
    s_size = mask.cache_size
    if (h % hkv or k.shape != (b, t, hkv, d) or v.shape != k.shape
            or cache_k is None or cache_k.shape != (b, hkv, s_size, d)
            or cache_v.shape != cache_k.shape):
        raise ValueError(f"shapes q {q.shape}, k {k.shape}, v {v.shape}, cache "
                         f"{None if cache_k is None else cache_k.shape} do not fit a step of "
                         f"{t} tokens after a cache of {s_size} slots")
    if mask.layout.size != t:
        raise ValueError(f"the mask's layout has {mask.layout.size} tokens, q has {t}")
    group = h // hkv
    dq, dk = default_blocks(backend, t * group)
    bq, bk = block_q or dq, block_k or dk
    if not interpret:
        _check_blocks(backend, bq, bk, d)
    bmap = BlockMap.of(mask.layout, group, bq, bk)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT

    # rows: token-major, the group's heads adjacent: [B, Hkv, T*group, D], padded
    rows = q.reshape(b, t, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * group, d)
    rows = _pad_axis(rows, 2, bmap.rows_padded)
    slots = bmap.cache_padded(s_size)
    ck, cv = (_pad_axis(x.astype(q.dtype), 2, slots) for x in (cache_k, cache_v))
    sk, sv = (_pad_axis(x.transpose(0, 2, 1, 3), 2, bmap.step_padded) for x in (k, v))
    if backend == "triton" and (d & (d - 1) or d < 16):
        # Triton tiles are powers of two, and a dot's dimensions at least 16: zero-pad D
        dp = max(16, pl.next_power_of_2(d))
        rows, ck, cv, sk, sv = (_pad_axis(x, 3, dp) for x in (rows, ck, cv, sk, sv))
    cache_len = mask.cache_len.astype(jnp.int32)
    call = _triton_call if backend == "triton" else _tpu_call
    out = call(rows, ck, cv, sk, sv, cache_len, bmap, scale=scale, precision=precision,
               interpret=interpret)
    out = out[:, :, : t * group, :d].reshape(b, hkv, t, group, d)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


@dataclasses.dataclass(frozen=True)
class PallasAttention:
    """An attention function fn(q, k, v, mask, cache_k, cache_v, **rules) for the model: the
    kernel for a lookahead step's `StepMask`, the dense reference for any other mask (prefill,
    plain decoding). Hashable, so a decoding method holding it stays a valid static argument of
    `jax.jit`.

    A layer's rules (`models.layers.dot_product_attention`): the kernel takes a score scale
    (Gemma's); it declines soft-capped scores (Gemma 2) and sliding-window layers (Mistral,
    Gemma's local layers, Phi-3): those layers run the dense reference over the expanded mask,
    the others the kernel (`declines(rules)` says which; a warning names them when traced).

    platform: the jax platform the compiled kernel is for; None: jax's default backend, checked
    when the kernel is traced. A platform given (e.g. 'cuda' or 'tpu', to `jax.export` a
    decoder for it from a CPU host) is checked here. Not used in interpret mode."""

    backend: str = "triton"
    interpret: bool = False
    block_q: int | None = None
    block_k: int | None = None
    platform: str | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {self.backend!r}: expected one of {BACKENDS}")
        if self.platform is not None and not self.interpret:
            check_platform(self.backend, self.platform)

    @staticmethod
    def declines(rules) -> tuple[str, ...]:
        """The rules of a layer that the kernel does not implement (that layer runs dense)."""
        return tuple(r for r in ("softcap", "window") if rules.get(r))

    def __call__(self, q, k, v, mask, cache_k=None, cache_v=None, **rules):
        if isinstance(mask, StepMask):
            declined = self.declines(rules)
            if not declined:
                return lookahead_attention(q, k, v, mask, cache_k, cache_v, backend=self.backend,
                                           interpret=self.interpret, block_q=self.block_q,
                                           block_k=self.block_k, platform=self.platform,
                                           scale=rules.get("scale"))
            warnings.warn(f"the Pallas lookahead attention kernel declines layers with "
                          f"{' and '.join(declined)}: they run the dense attention",
                          KernelDeclined, stacklevel=2)
            return dot_product_attention(q, k, v, mask.dense(), cache_k, cache_v, **rules)
        return dot_product_attention(q, k, v, mask, cache_k, cache_v, **rules)


class KernelDeclined(UserWarning):
    """A layer the Pallas kernel does not implement ran the dense attention instead."""
