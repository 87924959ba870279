"""The shared vocabulary of Conductor, at the bottom of the house.

Value types (roles, tiers, instance views, queued prefills, active decodes, cached prefixes, SLOs,
decisions), the error hierarchy, block keys and vLLM's block hashes, the tokenizer protocol, the
latency profile and the decision log record. Nothing here does I/O or imports another package of
the project (`tests/test_import_rules.py` holds that), so every other package may build on it:
the gateway, the simulator, the policies, the predictors and the adapters.

This module imports nothing itself: import the submodule you need.
"""
