"""Tiny looped language models (Ouro- and Raven-style) trained on this machine's offline text."""
