"""The global KV cache index: where each block of a prompt lives (see base.py)."""
