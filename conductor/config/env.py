"""Settings from the environment, parsed by pydantic-settings from the settings model's own types.

`CONDUCTOR_<FIELD>` (nested fields joined by `__`, e.g. `CONDUCTOR_SLO__TTFT_S=2`). A plain string
field takes the value exactly as written: `CONDUCTOR_AUTH__API_KEYS='sk-a #b'` is the key `sk-a #b`,
`null` is the key `null`, `12345` the key `12345` (a YAML reading would have cut the comment,
dropped the key, or made a number). Lists, mappings and nested models are JSON
(`CONDUCTOR_PREFILL='["http://p0:8100"]'`); the list fields named in `no_decode` (`CONDUCTOR_AUTH__API_KEYS`)
also take a single plain value as a one-item list.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, create_model
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict, SettingsError


class _EnvBase(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore")


class _Source(EnvSettingsSource):
    """pydantic-settings' environment source over a mapping we pass (tests give their own)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str], prefix: str) -> None:
        self._environ = environ
        super().__init__(settings_cls, case_sensitive=False, env_prefix=prefix, env_nested_delimiter="__")

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k.lower(): v for k, v in self._environ.items()}


def env_values(model: type[BaseModel], environ: Mapping[str, str], prefix: str, no_decode: Iterable[str] = ()) -> dict[str, Any]:
    """The values the environment gives for `model`'s fields, decoded as its types say (still to be
    validated by the model). Raises ValueError naming the variable when a value cannot be decoded.
    `no_decode` names top-level fields ("models") or fields of a nested model ("auth.api_keys")."""
    raw = set(no_decode)
    fields: dict[str, Any] = {name: (_view_type(name, field.annotation, raw), None) for name, field in model.model_fields.items()}
    view = create_model(f"{model.__name__}FromEnvironment", __base__=_EnvBase, **fields)
    try:
        values = _Source(view, environ, prefix)()
    except SettingsError as exc:
        raise ValueError(f"environment: {exc}") from exc
    for path in raw:
        group, _, name = path.rpartition(".")
        where = values.get(group) if group else values
        if isinstance(where, dict) and name in where:
            where[name] = _list_or_one(where[name])
    return values


def _view_type(name: str, annotation: Any, raw: set[str]) -> Any:
    """`annotation` as the environment view reads it: untouched, NoDecode, or a nested model whose
    fields named in `raw` ("group.field") are NoDecode."""
    if name in raw:
        return Annotated[annotation, NoDecode]
    inner = {path.partition(".")[2] for path in raw if path.startswith(name + ".")}
    if not inner or not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return annotation
    plain: dict[str, Any] = {key: (Annotated[annotation.model_fields[key].annotation, NoDecode], None) for key in inner}
    return create_model(f"{annotation.__name__}FromEnvironment", __base__=annotation, **plain)


def _list_or_one(value: Any) -> Any:
    """A JSON list as a list; any other text as a list of that one text, exactly as written."""
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                return [value]
        return [value]
    return value
