"""Latency predictor: held-out accuracy of stages 1 and 2 beside a roofline, and µs per call
(`python -m bench.predictor`)."""
