"""LoRA adapters on the emulated engine, served as vLLM serves them.

- Static adapters: `--lora-modules name=path` (or vLLM's JSON form `{"name", "path",
  "base_model_name"}`), loaded at start.
- Runtime loading, when allowed (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING; here that variable or
  `--allow-runtime-lora-updating`): `POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace?}`
  answers 200 with vLLM's plain-text "Success: ..." line; `POST /v1/unload_lora_adapter
  {lora_name}` likewise. vLLM's checks and their statuses: a missing field or a name that is the
  base model's 400, a second load of a loaded name without `load_inplace` 400, an unload of an
  unknown name 404. Not allowed: the routes do not exist (404 Not Found), as in vLLM.
- `/v1/models` lists each adapter after the base model: `root` its path, `parent` its base model
  (the served model unless the module named another), no `max_model_len` (vLLM's ModelCard).
- A request whose `model` names an adapter runs with it: every block hashes `(("lora", name,
  path),)` as its extra keys (vllm/v1/core/kv_cache_utils.py), and its BlockStored events carry
  `lora_id`, `lora_name` and per block the untagged extra keys `[name]` (kv_events.py). An unknown
  model or adapter is vLLM's 404 "The model `x` does not exist." (openai_format.served_model_of).
- Each adapter gets vLLM's `lora_int_id`: a counter from 1, kept when a name is loaded again in place.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from adapters.emulator.openai_format import ApiError

__all__ = ["LoraAdapter", "LoraAdapters", "LoraModule", "parse_lora_modules", "runtime_updates_allowed"]

_TRUE = ("1", "true")


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One `--lora-modules` entry: vLLM's LoRAModulePath."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A loaded adapter."""

    name: str
    path: str
    base: str  # the base model its card names as `parent`
    lora_id: int  # vLLM's lora_int_id on this engine

    @property
    def extra_keys(self) -> tuple[tuple[str, str, str], ...]:
        """What vLLM hashes into every block of a request that uses it."""
        return (("lora", self.name, self.path),)


def parse_lora_modules(values: Sequence[str]) -> tuple[LoraModule, ...]:
    """vLLM's `--lora-modules` values: `name=path`, or a JSON object (name, path, base_model_name)."""
    modules: list[LoraModule] = []
    for item in values:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            modules.append(LoraModule(name, path))
            continue
        try:
            fields = json.loads(item)
            modules.append(LoraModule(**fields))
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"invalid --lora-modules value {item!r}: {exc}") from None
    return tuple(modules)


def runtime_updates_allowed(environ: dict[str, str] | Any) -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING as vLLM reads it ("1" or "true", any case)."""
    return str(environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")).strip().lower() in _TRUE


class LoraAdapters:
    """The adapters one engine holds, and vLLM's load and unload rules."""

    def __init__(self, base_model: str, modules: Sequence[LoraModule] = (), *, runtime_updates: bool = False) -> None:
        self.base_model = base_model
        self.runtime_updates = runtime_updates
        self._adapters: dict[str, LoraAdapter] = {}
        self._next_id = 1
        for module in modules:  # vLLM's init_static_loras: a bad one stops the start
            self.load(module.name, module.path, base=module.base_model_name)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __iter__(self) -> Iterator[LoraAdapter]:
        return iter(list(self._adapters.values()))

    def get(self, name: str) -> LoraAdapter | None:
        return self._adapters.get(name)

    def load(self, name: Any, path: Any, *, base: str | None = None, inplace: bool = False) -> LoraAdapter:
        """Load (or, `inplace`, reload) `name` from `path`; ApiError as vLLM answers a bad load."""
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.base_model:
            raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")
        previous = self._adapters.get(name)
        if previous is not None and not inplace:
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        if previous is not None:
            lora_id = previous.lora_id
        else:
            lora_id, self._next_id = self._next_id, self._next_id + 1
        adapter = self._adapters[name] = LoraAdapter(name, path, base or self.base_model, lora_id)
        return adapter

    def unload(self, name: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if self._adapters.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")

    def update(self, path: str, body: Any) -> str:
        """A runtime load or unload request (`path` says which); vLLM's success line, else ApiError."""
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        name = body.get("lora_name")
        if path.endswith("/load_lora_adapter"):
            self.load(name, body.get("lora_path"), inplace=bool(body.get("load_inplace", False)))
            return f"Success: LoRA adapter '{name}' added successfully."
        self.unload(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self, created: int) -> list[dict[str, Any]]:
        """The adapters' `/v1/models` cards, as vLLM's show_available_models lists them."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": a.path,
                "parent": a.base,
                "max_model_len": None,
                "permission": [],
            }
            for a in self
        ]
