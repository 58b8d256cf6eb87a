"""Finetune engine: LoRA training on the decode engine's own base weights, in bounded quanta.

Entry points (see README.md):

* :meth:`gpu_runtime.finetune.trainer.LoraTrainer.step_quantum` — one bounded unit of training
  (a micro-batch, or a few decoder layers of one) returning a
  :class:`~gpu_runtime.finetune.quantum.QuantumResult`;
* :class:`gpu_runtime.finetune.dpo_trainer.DpoTrainer` — the same quanta with DPO's loss over
  preference pairs (:mod:`gpu_runtime.finetune.preference_data`), the adapter-off base model as
  the reference;
* :mod:`gpu_runtime.finetune.checkpoint` — adapters in PEFT format and whole-trainer checkpoints
  for exact resume.
"""
