"""Benchmark scripts; each writes bench/results/<name>-<gpu>-<date>.json."""
