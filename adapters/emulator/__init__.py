"""An emulated vLLM worker: vLLM's HTTP API, P/D handshakes, prefix cache, KV events and metrics,
with timing from a profile. Run it with `conductor emulate ...` or `python -m adapters.emulator ...`."""
