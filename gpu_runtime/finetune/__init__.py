"""Finetune engine: LoRA training on the decode engine's own base weights, in bounded quanta."""
