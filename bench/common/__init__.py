"""What every benchmark package shares: provenance and the result file, request traces, the GPU's
state, command-line types, timing helpers and synthetic finetune data."""
