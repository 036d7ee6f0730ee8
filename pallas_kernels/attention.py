"""Choosing the attention a lookahead step runs: `--attention=dense|pallas|auto`.

  dense   the dense reference (`dense_attention`): any platform.
  pallas  the block-sparse Pallas kernel (`lookahead_attention.py`): Triton on GPU, Mosaic on
          TPU. Elsewhere it raises `KernelUnavailable`, unless `interpret=True` (the kernel
          run by the Pallas interpreter: slow, any platform, what the tests use on CPU), or
          the platform is named (`select_attention('pallas', 'cuda')`): a kernel built for
          that platform, to lower or export for it from this host.
  auto    the kernel where the platform has one (GPU, TPU), dense otherwise.

An attention function has the model's signature `fn(q, k, v, mask, cache_k, cache_v, **rules)`
(rules: a family's own scale, soft-cap or sliding window, `models.layers.dot_product_attention`).
Only the lookahead step passes a `StepMask`; the kernel falls back to the dense path for any
other mask (prefill, plain decoding), and for layers whose rules it declines (soft-capped and
sliding-window ones), so one function serves every model call.
"""

from __future__ import annotations

from typing import Any

import jax

from models.config import ConfigError
from lookahead_jax.lookahead.mask import dense_attention
from pallas_kernels.platform import KERNEL_BACKENDS, KernelUnavailable

ATTENTION_NAMES = ("dense", "pallas", "auto")

def select_attention(name: str, platform: str | None = None, *, interpret: bool = False,
                     block_q: int | None = None, block_k: int | None = None):
    """'dense' | 'pallas' | 'auto' -> an attention function fn(q, k, v, mask, cache_k, cache_v).

    platform: a jax platform name ('cpu', 'gpu', 'cuda', 'rocm', 'tpu'); default: jax's
    default backend. A platform given is passed on to the compiled kernel, which is then built
    for it whatever this host is: `select_attention('pallas', 'cuda')` on a CPU host traces
    (lowers, exports) for a GPU but cannot run here; `select_attention('pallas')` raises
    `KernelUnavailable` on a host without a GPU or TPU.
    interpret: run the kernel in the Pallas interpreter (any platform; the platform then only
    picks the kernel: Mosaic for 'tpu', else Triton).
    """
    if name not in ATTENTION_NAMES:
        raise ConfigError(f"attention must be one of {ATTENTION_NAMES}, got {name!r}")
    given = platform
    platform = platform or jax.default_backend()
    backend = KERNEL_BACKENDS.get(platform)
    if name == "dense" or (name == "auto" and backend is None):
        return dense_attention
    if backend is None:
        if not interpret:
            raise KernelUnavailable(
                f"the Pallas lookahead attention kernel runs on GPU (Triton) or TPU (Mosaic), "
                f"not on platform {platform!r}: use attention 'dense' or 'auto' (or interpret "
                f"mode, for testing)")
        backend = "triton"
    from pallas_kernels.lookahead_attention import PallasAttention  # noqa: PLC0415
    return PallasAttention(backend, interpret=interpret, block_q=block_q, block_k=block_k,
                           platform=None if interpret else given)


def resolve_attention(attention: Any):
    """A name (see `select_attention`, for the default platform) or an attention function ->
    an attention function."""
    if isinstance(attention, str):
        return select_attention(attention)
    if not callable(attention):
        raise ConfigError(f"attention must be a name {ATTENTION_NAMES} or a function, "
                          f"got {attention!r}")
    return attention
