"""Decoding looped models: the candidate tree, speculative sampling, LoopSpec, LoopAhead and its drafter."""
