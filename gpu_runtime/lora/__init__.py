"""Serving finished LoRA adapters beside base-model requests: the host adapter store, the
stacked GPU slots, the decode step's shrink/expand (Triton on CUDA, a torch reference
elsewhere) and the runtime the decode engine holds (see README.md)."""
