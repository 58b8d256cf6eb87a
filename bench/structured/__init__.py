"""Structured output's cost in decode (`python -m bench.structured`; see `run.py`)."""
