"""Small checkpoints shipped with the package (see README.md here): package data, so an
installed library finds them without a source checkout (`store.presets.shipped_checkpoint`)."""
