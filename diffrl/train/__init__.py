"""Training: the engine (LoRA / full fine-tuning, FSDP2), checkpoints, weight export."""
