"""Where the Pallas kernel runs: jax platform -> Pallas backend, and the error raised elsewhere."""

from __future__ import annotations

# jax platform -> the kernel's Pallas backend
KERNEL_BACKENDS = {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu"}


class KernelUnavailable(RuntimeError):
    """The Pallas kernel cannot run (compiled) on this platform."""
