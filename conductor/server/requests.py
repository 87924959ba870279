"""Reading and checking an OpenAI request body before anything is routed.

Every malformed body is a 400 here, never a 500 further on. The checks, in order: a nesting depth
limit on the raw bytes (so the JSON decoder never recurses deeply), JSON syntax, then the types of
every field the gateway or the workers' tokenizer path reads, enforced by the strict pydantic models
below. Those models are also the request bodies of the OpenAPI document (`conductor/server/app.py`), so
the document says exactly what is enforced. Fields the models do not name are never rejected:
vLLM accepts many sampling fields of its own, and they are passed through untouched.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Collection, Mapping, MutableMapping
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    ValidationError,
    WithJsonSchema,
)

from conductor.core.errors import BadRequest, ModelNotFound, PayloadTooLarge
from conductor.kv.analysis import MAX_TOKEN_ID, RequestKind, check_token_ids

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

MAX_DEPTH = 64  # JSON nesting; OpenAI bodies need ~6, tool JSON schemas a few more
MAX_GENERATION_TOKENS = 1 << 24  # max_tokens above this is a typo, and would overflow the predictors
MAX_CHOICES = 128  # OpenAI's own limit on n

_decode = msgspec.json.Decoder().decode
_CLIENT_ID_RE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")

# ---- the schema ------------------------------------------------------------------------------

Text = Annotated[str, Field(min_length=1)]


def _integral(value: Any) -> Any:
    # JSON Schema's "integer" and vLLM's (lax) pydantic models both take 3.0 as 3; strict mode,
    # which keeps "3" and true from passing as 3, would not
    return int(value) if type(value) is float and value.is_integer() else value


# the bounds go before the validator, or pydantic writes them into the JSON schema as "ge"/"le"
GenerationTokens = Annotated[int, Field(ge=1, le=MAX_GENERATION_TOKENS), BeforeValidator(_integral)]
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES), BeforeValidator(_integral)]
_TOKEN_IDS_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "exclusiveMaximum": MAX_TOKEN_ID}}


def _list_of_ids(value: Any) -> Any:
    # Only the shape here; the ids themselves are checked by `check_token_ids` (msgspec, several
    # times faster on long prompts than pydantic's per-item validation) against the vocabulary.
    if not isinstance(value, list) or not value:
        raise ValueError("expected a non-empty list of token ids")
    return value


def _prompt_form(value: Any) -> str:
    # Which of the four prompt forms a value claims to be, from its first element, so only that
    # form is validated (and one wrong element gives one error, not one per form).
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return "strings"
        return "id-lists" if isinstance(first, list) else "ids"
    return "strings" if isinstance(value, list) else "string"


Prompt = Annotated[
    Annotated[Text, Tag("string")]
    | Annotated[Annotated[list[Text], Field(min_length=1, fail_fast=True)], Tag("strings")]
    | Annotated[Any, PlainValidator(_list_of_ids), WithJsonSchema(_TOKEN_IDS_SCHEMA), Tag("ids")]
    | Annotated[
        Any,
        PlainValidator(_list_of_ids),
        WithJsonSchema({"type": "array", "minItems": 1, "items": _TOKEN_IDS_SCHEMA}),
        Tag("id-lists"),
    ],
    Discriminator(_prompt_form),
]


class _Body(BaseModel):
    # strict: "5" is not 5 and true is not 1; extra fields are the workers' business
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Body):
    """A text content part: the gateway tokenizes its text."""

    type: Literal["text"]
    text: str


class OtherPart(_Body):
    """Any other content part (image_url, input_audio, ...): passed to the workers as it is."""

    model_config = ConfigDict(json_schema_extra={"additionalProperties": True})
    type: Annotated[str, Field(json_schema_extra={"not": {"const": "text"}})]


def _part_kind(value: Any) -> str:
    return "text-part" if isinstance(value, dict) and value.get("type") == "text" else "other-part"


ContentPart = Annotated[
    Annotated[TextPart, Tag("text-part")] | Annotated[OtherPart, Tag("other-part")],
    Discriminator(_part_kind),
]


def _content_form(value: Any) -> str:
    return "parts" if isinstance(value, list) else "string"


Content = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(_content_form),
]


class Message(_Body):
    model_config = ConfigDict(json_schema_extra={"additionalProperties": True})
    role: Text
    content: Content | None = None  # null: an assistant turn that only calls tools


class StreamOptions(_Body):
    model_config = ConfigDict(json_schema_extra={"additionalProperties": True})
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Request(_Body):
    model_config = ConfigDict(json_schema_extra={"additionalProperties": True})
    model: Text
    max_tokens: GenerationTokens | None = None
    n: Choices | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    add_special_tokens: bool | None = None  # the gateway's tokenizer honours it, as vLLM does


class CompletionRequest(_Request):
    """POST /v1/completions. Other fields vLLM knows (seed, logprobs, ...) are passed through."""

    prompt: Prompt


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions. Other fields vLLM knows (tools, seed, ...) are passed through."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: GenerationTokens | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # spread into the chat template's variables


SCHEMAS: dict[RequestKind, type[_Request]] = {"completions": CompletionRequest, "chat": ChatCompletionRequest}

# what each field must be, for messages that say more than the first failing constraint
_EXPECTED = {
    "model": "a non-empty string",
    "prompt": "a non-empty string, a list of strings, a list of token ids or a list of lists of token ids",
    "messages": "a non-empty list of objects with a string 'role' and a 'content' that is a string, "
    "null or a list of content parts (a text part's 'text' is a string)",
    "max_tokens": f"an integer from 1 to {MAX_GENERATION_TOKENS}",
    "max_completion_tokens": f"an integer from 1 to {MAX_GENERATION_TOKENS}",
    "n": f"an integer from 1 to {MAX_CHOICES}",
    "stream": "a boolean",
    "stream_options": "an object with boolean 'include_usage' and 'continuous_usage_stats'",
    "stop": "a string or a list of strings",
    "chat_template_kwargs": "an object",
    "add_special_tokens": "a boolean",
}
_INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "n")
_MODELS: tuple[type[BaseModel], ...] = (*SCHEMAS.values(), Message, TextPart, StreamOptions)
_FIELD_NAMES = frozenset(name for model in _MODELS for name in model.model_fields)

# ---- nesting depth ---------------------------------------------------------------------------

# +1 for an opening bracket, -1 for a closing one, 0 for every other byte
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_QUOTE = ord('"')
_CHUNK = 1 << 20  # bytes per numpy pass: bounds the temporary arrays whatever the body's size


def nesting_depth(raw: bytes, limit: int = MAX_DEPTH) -> int:
    """How deep the arrays and objects of a JSON text nest, without parsing it (no recursion, no
    Python loop over bytes): brackets inside strings do not count, then the deepest running count
    of open brackets is taken. Returns a value <= `limit` without looking closer when the body has
    that few brackets at all (nearly every request)."""
    bound = raw.count(b"[") + raw.count(b"{")
    if bound <= limit:
        return bound
    if b"\\" in raw:
        # Drop escape pairs so the only quotes left open or close strings. Left to right, as a
        # JSON reader pairs them: an escaped backslash first, then an escaped quote.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(raw, dtype=np.uint8)
    depth = deepest = in_string = 0
    for start in range(0, data.size, _CHUNK):
        chunk = data[start : start + _CHUNK]
        # parity of the quotes so far: 1 from an opening quote up to its closing one
        inside = np.bitwise_xor.accumulate((chunk == _QUOTE).view(np.uint8)) ^ in_string
        in_string = int(inside[-1])
        steps = _STEP[chunk]
        steps[inside == 1] = 0
        running = np.cumsum(steps, dtype=np.int32) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return deepest


# ---- reading and checking --------------------------------------------------------------------


async def read_body(receive: Receive, content_length: int | None, limit: int) -> bytes:
    """The whole request body, refusing (413) as soon as it is known to exceed `limit`."""
    if content_length is not None and content_length > limit:
        raise PayloadTooLarge(f"request body of {content_length} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("client went away before the body was read")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks) if len(chunks) != 1 else chunks[0]


def _path(loc: tuple[int | str, ...]) -> str:
    # pydantic puts union tags and member names into error locations; only field names and
    # list indexes make a path a client can follow
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES:
            out += f".{part}" if out else part
    return out


def _bad_request(exc: ValidationError) -> BadRequest:
    errors = exc.errors(include_url=False, include_input=False)
    # the deepest location is the most specific: for a union, the member that got furthest
    error = max(errors, key=lambda e: len(_path(e["loc"])))
    path = _path(error["loc"])
    field = path.split("[", 1)[0].split(".", 1)[0] or None
    message = f"invalid '{path}': {error['msg']}" if path else error["msg"]
    if field in _EXPECTED:
        message += f" ('{field}' must be {_EXPECTED[field]})"
    return BadRequest(message, param=field)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body decoded as one JSON object, nesting bounded before decoding (400 otherwise)."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise BadRequest(f"request body nests arrays and objects {depth} levels deep; the limit is {MAX_DEPTH}")
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # a malformed body the depth count could not see through
        raise BadRequest("request body nests too deeply") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def parse_request(raw: bytes, kind: RequestKind, *, vocab_size: int | None = None) -> dict[str, Any]:
    """The JSON object of a completions or chat request, with every field the gateway reads
    checked (400 otherwise); token ids must be below `vocab_size` when the tokenizer knows one.
    Fields the gateway does not know are kept as they are, for the workers."""
    body = json_object(raw)
    try:
        SCHEMAS[kind].model_validate(body)
    except ValidationError as exc:
        raise _bad_request(exc) from None
    for name in _INTEGER_FIELDS:  # validated as integral: forwarded, and read here, as integers
        if type(body.get(name)) is float:
            body[name] = int(body[name])
    if kind == "completions":
        body["prompt"] = check_token_ids(body["prompt"], vocab_size)
    return body


def check_model(model: str, known: Collection[str]) -> None:
    """404 for a model the gateway does not know; nothing known yet (`known` empty): any passes."""
    if known and model not in known:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")


def resolve_model(body: dict[str, Any], known: Collection[str], aliases: Mapping[str, str]) -> str | None:
    """Check the body's model (404 when unknown) and rewrite an alias to the served name, once,
    before anything reads it: the analyzer, the router and the workers all see the served name.
    The served name when the gateway knows it, else None (nothing known yet): what metrics may
    count by, never a string only the client chose."""
    model = body["model"]
    check_model(model, known)
    served = aliases.get(model) if aliases else None
    if served is not None:
        body["model"] = served
        return served
    return model if model in known else None


def max_tokens_of(body: dict[str, Any], default: int) -> int:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and value > 0 else default


# ---- /v1/embeddings and /v1/responses: forwarded as they are to mixed workers -------------------

PASS_THROUGH_KINDS = ("embeddings", "responses")


def parse_pass_through(raw: bytes, kind: str) -> dict[str, Any]:
    """The JSON object of an embeddings or Responses API request: the fields the gateway reads
    (model, input, stream, max_output_tokens) checked; the rest is the worker's to judge."""
    body = json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    value = body.get("input")
    if not isinstance(value, str | list) or not value:
        raise BadRequest("'input' must be a non-empty string or list", param="input")
    if kind == "responses":
        if not isinstance(body.get("stream", False), bool | None):
            raise BadRequest("'stream' must be a boolean", param="stream")
        limit = body.get("max_output_tokens")
        if limit is not None and (type(limit) is not int or not 1 <= limit <= 2**24):
            raise BadRequest("'max_output_tokens' must be an integer from 1 to 16777216", param="max_output_tokens")
    elif body.get("stream"):
        raise BadRequest("embeddings are not streamed", param="stream")
    return body


def estimate_input_tokens(body: Mapping[str, Any]) -> int:
    """Rough prompt size of an embeddings / Responses input (no tokenizer: ~4 characters a token,
    token-id lists counted exactly); enough for load accounting, not for KV matching."""
    value = body.get("input")
    if isinstance(value, str):
        return max(1, len(value) // 4)
    total = 0
    for item in value if isinstance(value, list) else ():
        if isinstance(item, int):
            total += 1
        elif isinstance(item, list) and all(isinstance(t, int) for t in item):
            total += len(item)
        else:
            total += max(1, len(msgspec.json.encode(item)) // 4)
    return max(1, total)


def client_request_id(value: str | None) -> str | None:
    """The client's X-Request-ID when it is a plain token (echoed back, logged); else None."""
    if value is None or not _CLIENT_ID_RE.fullmatch(value):
        return None
    return value
