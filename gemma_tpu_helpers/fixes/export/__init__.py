"""From a LoRA checkpoint to safetensors: the merge plan and writer, the weight check, verify (logits parity), the PEFT
export."""
