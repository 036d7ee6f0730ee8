"""Pallas kernels for lookahead decoding.

  attention.py            `select_attention('dense' | 'pallas' | 'auto')`
  platform.py             which Pallas backend each jax platform has, `KernelUnavailable`
  block_map.py            `BlockMap`: which attention tiles of a step hold a visible key
  lookahead_attention.py  the block-sparse flash-attention kernel: Triton (GPU), Mosaic (TPU)
  block_stats.py          `python -m pallas_kernels.block_stats`: tiles computed / skipped
  gpu_bench.py            `python -m pallas_kernels.gpu_bench`: exactness and timings on a GPU

The kernels depend only on the description of a step's mask, `lookahead_jax.lookahead.layout`
(`StepLayout`) and `lookahead_jax.lookahead.mask` (`StepMask`, `dense_attention`). Nothing is
imported here, so `lookahead_jax.lookahead.step` can use `attention` without loading Pallas.
"""
