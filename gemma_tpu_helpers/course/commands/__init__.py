"""The command line (python -m gemma_tpu_helpers): its parser and one module per group of commands, and the hardware
report."""
