"""Conductor: a KVCache-aware global scheduler for P/D-disaggregated LLM serving."""

__version__ = "0.1.0"
