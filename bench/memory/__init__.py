"""Unified memory: the pool against a static split of the same memory on a bursty trace
(`python -m bench.memory trace`), the CUDA virtual-memory facts the pool is built on
(`python -m bench.memory mechanism`), the pool's host work per iteration on the CPU
(`python -m bench.memory.host_hooks`) and equal-batch comparisons of a trace's iterations
(`python -m bench.memory.equal_batch`)."""
