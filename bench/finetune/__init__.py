"""Finetune speed: LoRA training tokens/s solo against HF + PEFT on the same model
(`python -m bench.finetune`)."""
