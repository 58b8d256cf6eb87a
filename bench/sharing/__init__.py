"""GPU sharing: decode and finetune work on SM partitions and prioritised streams
(`python -m bench.sharing`), and cuBLAS SM-count targets on a partition
(`python -m bench.sharing.carveout`)."""
