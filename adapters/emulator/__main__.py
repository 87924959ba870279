"""`python -m adapters.emulator ...` runs one emulated vLLM instance (same flags as `conductor emulate`)."""

from adapters.emulator.cli import emulate_main

raise SystemExit(emulate_main())
