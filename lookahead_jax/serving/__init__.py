"""Serving: the slot engine (continuous batching), the request scheduler and the OpenAI-compatible HTTP server (`python -m lookahead_jax.serve`)."""
