"""Choosing settings: the scaling law, the step-cost curve, --auto."""
