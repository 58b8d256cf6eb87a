"""Decode-latency prediction on the runtime host: schema, artifact loading, ONNX inference."""
