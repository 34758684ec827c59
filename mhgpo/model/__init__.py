"""Models: loading (HF, GGUF, trained runs), LoRA, generation engines, log-probs, precision, FSDP, checkpoints."""
