"""Pallas kernels for lookahead decoding.

  step_mask.py            `StepMask`: the structured mask a lookahead step hands the model's
                          attention (cache lengths + `StepLayout`), and `dense_attention`
  attention.py            `select_attention('dense' | 'pallas' | 'auto')`, `KernelUnavailable`
  block_map.py            `BlockMap`: which attention tiles of a step hold a visible key
  lookahead_attention.py  the block-sparse flash-attention kernel: Triton (GPU), Mosaic (TPU)
  block_stats.py          `python -m pallas_kernels.block_stats`: tiles computed / skipped
  gpu_bench.py            `python -m pallas_kernels.gpu_bench`: exactness and timings on a GPU

Nothing is imported here, so `lookahead_jax.step` can use `step_mask` and `attention` without
loading Pallas.
"""
