"""Training: the data pipeline (chat tokens, packing), LoRA (dense and experts), remat, the SFT loss and step, multi-
host runs, preemption, LoRA checkpoints."""
