"""Tokenizing at the gateway: a local Hugging Face tokenizer directory, or a worker's /tokenize.

Never a hub download: `HFTokenizer` reads `tokenizer.json` (the `tokenizers` library) and the chat
template from `tokenizer_config.json` (or `chat_template.jinja` / `chat_template.json`) in a
directory on disk. Chat prompts are rendered as vLLM renders them through transformers'
`apply_chat_template(messages, tokenize=False, ...)`: a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks, the tokenizer's special tokens as variables, a `raise_exception`
global and a `tojson` filter. The template gets what vLLM's chat endpoint passes it
(`chat_template_arguments`): the request's `tools` (as vLLM's tool model dumps them), `documents`,
`add_generation_prompt` (default true), `continue_final_message`, then `chat_template_kwargs` on
top. A tool-calling prompt rendered without its tools is a different prompt: its keys would never
match the workers' cache. The text is then encoded without adding special tokens (the template
already holds them) unless the request sets `add_special_tokens`. Completions prompts are encoded
with special tokens, as vLLM does for a text prompt.

All tokenizers are used through the async `PromptTokenizer` protocol, so the gateway treats a local
tokenizer and a remote /tokenize alike.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import httpx

from conductor.core.errors import ConfigError, UpstreamError
from conductor.core.tokenization import Tokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class PromptTokenizer(Protocol):
    """Token ids of a completions prompt and of a chat conversation, as the workers would see them."""

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> list[int]: ...

    async def close(self) -> None: ...


class LocalTokenizer:
    """Any synchronous `conductor.core.tokenization.Tokenizer` (the built-in byte tokenizer, HF) as async."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int | None:
        """Token ids this tokenizer can produce are below this; None when it does not say."""
        size = getattr(self.tokenizer, "vocab_size", None)
        return size if isinstance(size, int) else None

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text)  # the built-in byte tokenizer adds no special tokens

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages)

    async def close(self) -> None:
        return None


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _parts_text(parts: list[Any]) -> str:
    return "\n".join(
        text for p in parts if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(text := p.get("text"), str)
    )


def _tool_dict(tool: Any) -> Any:
    """One tool as vLLM hands it to the template: its pydantic model dumped, so the declared function
    fields (name, description, parameters) are always there, None when the client left them out."""
    if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
        return tool
    fn = tool["function"]
    declared = {"name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters")}
    return {"type": tool.get("type", "function"), "function": {**declared, **fn}}


def chat_template_arguments(body: Mapping[str, Any]) -> dict[str, Any]:
    """The variables vLLM's chat endpoint renders the template with, besides the messages: tools,
    documents, add_generation_prompt, continue_final_message, then the request's
    chat_template_kwargs over them (vLLM lets those override)."""
    tools = body.get("tools")
    args: dict[str, Any] = {
        "tools": [_tool_dict(t) for t in tools] if isinstance(tools, list) and tools else None,
        "documents": body.get("documents"),
        "add_generation_prompt": body.get("add_generation_prompt", True) is not False,
        "continue_final_message": body.get("continue_final_message") is True,
    }
    extra = body.get("chat_template_kwargs")
    if isinstance(extra, Mapping):
        args.update(extra)
    return args


def _final_text(messages: Sequence[Mapping[str, Any]]) -> str | None:
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):  # the last text part, as transformers takes it
        texts = [p.get("text") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
        return texts[-1] if texts else None
    return content if isinstance(content, str) else None


def _cut_after_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """continue_final_message: the prompt ends inside the last message, right after its text (what
    transformers does: find the text's last occurrence, keep its leading part and, when the template
    kept it verbatim, its trailing whitespace)."""
    final = _final_text(messages)
    if final is None or final.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the rendered chat")
    at = rendered.rindex(final.strip())
    kept = final.lstrip()
    if rendered[at : at + len(kept)] != kept:
        kept = final.strip()
    return rendered[: at + len(kept)]


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _load_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = directory / "chat_template.json"
    template: Any = config.get("chat_template")
    if template is None and json_file.is_file():
        template = json.loads(json_file.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: vLLM uses the one called "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class HFTokenizer:
    """A Hugging Face tokenizer directory read from disk; satisfies `Tokenizer`."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.directory = Path(directory)
        tok_file = self.directory / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(f"no tokenizer.json in {self.directory} (the gateway never downloads one)")
        self._tok = RustTokenizer.from_file(str(tok_file))
        config_file = self.directory / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special_tokens = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        source = _load_template(self.directory, config)
        self._template = self._compile(source) if source else None

    @staticmethod
    def _compile(source: str) -> Any:
        # jinja2 is only needed for chat templates; imported here so the core does not require it
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(source)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> str:
        """The prompt text vLLM would build for these messages; `extra` are the template arguments
        (`chat_template_arguments`: tools, documents, add_generation_prompt, ...)."""
        if self._template is None:
            raise ConfigError(f"{self.directory} has no chat template (tokenizer_config.json chat_template)")
        # vLLM hands string-format templates the text parts of a content list joined by newlines
        plain = [{**m, "content": _parts_text(m["content"])} if isinstance(m.get("content"), list) else dict(m) for m in messages]
        variables: dict[str, Any] = {
            "messages": plain,
            "add_generation_prompt": True,
            "tools": None,
            "documents": None,
            **self.special_tokens,
            **extra,
        }
        text = str(self._template.render(**variables))
        return _cut_after_final_message(text, plain) if variables.get("continue_final_message") else text

    @functools.cached_property
    def vocab_size(self) -> int:
        """One more than the largest token id, added tokens included (what vLLM checks prompt
        token ids against); computed once, the vocabulary can be large."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token stands for: its longest vocabulary entry (byte-level
        entries spell one character per byte, never fewer than the text's characters)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_plain(self, text: str) -> list[int]:
        """Without added special tokens: for rendered chat prompts, which carry their own."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode_plain(self.render_chat(messages))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids)))


class HFPromptTokenizer(LocalTokenizer):
    """HFTokenizer, honouring per-request chat_template_kwargs; big prompts tokenized off the loop."""

    OFFLOAD_CHARS = 64 * 1024  # beyond this, tokenizing takes milliseconds: run it in a thread

    def __init__(self, tokenizer: HFTokenizer) -> None:
        super().__init__(tokenizer)
        self.hf = tokenizer

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encode = self.hf.encode if add_special_tokens else self.hf.encode_plain
        if len(text) > self.OFFLOAD_CHARS:
            return await asyncio.to_thread(encode, text)
        return encode(text)

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> list[int]:
        text = self.hf.render_chat(messages, **chat_template_arguments(body))
        # vLLM's chat default: no special tokens beyond those the template writes
        encode = self.hf.encode if body.get("add_special_tokens") is True else self.hf.encode_plain
        if len(text) > self.OFFLOAD_CHARS:
            return await asyncio.to_thread(encode, text)
        return encode(text)


class WorkerTokenizer:
    """Asks a vLLM worker's POST /tokenize (completions: `prompt`; chat: `messages`)."""

    def __init__(
        self, base_url: str, *, model: str | None = None, timeout_s: float = 5.0, client: httpx.AsyncClient | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._own = client is None
        self.vocab_size: int | None = None  # the worker checks token ids itself

    async def _tokenize(self, payload: dict[str, Any]) -> list[int]:
        if self.model is not None:
            payload.setdefault("model", self.model)
        try:
            resp = await self._client.post(f"{self.base_url}/tokenize", json=payload)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"/tokenize at {self.base_url} failed: {exc!r}") from exc
        if resp.status_code != 200:
            raise UpstreamError(
                f"/tokenize at {self.base_url} answered {resp.status_code}: {resp.text[:200]}", upstream_status=resp.status_code
            )
        return [int(t) for t in resp.json()["tokens"]]

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._tokenize({"prompt": text, "add_special_tokens": add_special_tokens})

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> list[int]:
        payload: dict[str, Any] = {
            "messages": list(messages),
            "add_generation_prompt": body.get("add_generation_prompt", True) is not False,
        }
        # the worker renders its own template: hand it what shapes the prompt, as the chat request has it
        for key in ("model", "tools", "documents", "continue_final_message", "add_special_tokens", "chat_template_kwargs"):
            if body.get(key) is not None:
                payload[key] = body[key]
        return await self._tokenize(payload)

    async def close(self) -> None:
        if self._own:
            await self._client.aclose()
