"""Lookahead Decoding: settings, the step's layout and mask, the window, the n-gram pool, the verifier, the step, lookahead parallelism."""
