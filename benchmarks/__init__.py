"""Benchmark scripts: each prints a Markdown table and writes JSON (see README.md)."""
