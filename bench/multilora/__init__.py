"""Multi-LoRA serving: decode steps with adapters in the batch against base-model steps
(`python -m bench.multilora`)."""
