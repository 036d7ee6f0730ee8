"""Models on disk: presets, checkpoint loading, the tokenizer, the embedded default model's store."""
