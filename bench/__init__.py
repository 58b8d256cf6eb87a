"""Benchmark packages, one per question, each run as ``python -m bench.<question>`` from the
repository root; each writes ``bench/results/<name>-<gpu>-<yyyymmdd>.json`` (see README.md)."""
