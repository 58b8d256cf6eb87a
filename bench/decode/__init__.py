"""Decode speed: TPOT per batch and context against the HBM floor, HF eager and HF static cache
+ compile (`python -m bench.decode`); the decode studies beside it: paged-attention splits
(`python -m bench.decode.attention`), prefill-chunk steps (`python -m bench.decode.chunks`) and
the Triton kernels' registers (`python -m bench.decode.kernel_registers`)."""
