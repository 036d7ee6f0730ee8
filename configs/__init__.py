"""Presets, one file per model: `get_config()` returns a `lookahead_jax.store.presets.Preset`.

Pick one with `python -m lookahead_jax.decode --config=<file name>` or
`Engine.from_preset("<file name>")`. Lookahead settings follow the Lookahead Decoding paper's
Table 4 (A100, G = W): 7B W=15 N=5; 13B W=10 N=5; 33/34B W=7 N=5.
"""
