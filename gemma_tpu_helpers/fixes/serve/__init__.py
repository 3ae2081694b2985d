"""Serving with vLLM: its command line, the server and its client, LoRA adapters."""
