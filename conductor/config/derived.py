"""What the settings imply, worked out in one place for the gateway and the indexer service: the KV
options with the gateway settings filled in, and whether prefill-to-prefill pulls are possible."""

from __future__ import annotations

from conductor.config.kv import KVAwarenessSettings, KVEventsEndpoint
from conductor.config.settings import Settings


def kv_settings(settings: Settings) -> KVAwarenessSettings:
    """The KV-awareness options with what the gateway settings already say filled in: the block size,
    each instance's KV events endpoint, and whether prompts may be forwarded as token ids (only with
    the model's own tokenizer, unless asked: the built-in one's ids mean nothing to a real model)."""
    kv = settings.kv
    events = {
        spec.name: KVEventsEndpoint(endpoint=spec.kv_events_endpoint, replay_endpoint=spec.kv_events_replay_endpoint)
        for spec in settings.instances()
        if spec.kv_events_endpoint and spec.name
    }
    update: dict[str, object] = {"block_size": settings.block_size, "kv_events": {**events, **kv.kv_events}}
    if kv.index == "indexer" and kv.indexer_model is None and settings.models:
        update["indexer_model"] = settings.models[0]  # the indexer checks it against the same `models`
    update["forward_token_ids"] = forwards_token_ids(kv)
    update["keep_token_ids"] = peer_pull_possible(settings)
    return kv.model_copy(update=update)


def peer_pull_possible(settings: Settings) -> bool:
    """Whether prefill-to-prefill pulls can be staged at all: NIXL P/D, KV awareness on (block keys
    say who holds what), and the gateway's token ids the workers' own (a model tokenizer, or
    kv.forward_token_ids set): the staging request names the prefix by them."""
    return (
        settings.pd.peer_pull != "off"
        and settings.disaggregated
        and settings.pd.protocol == "nixl"
        and settings.kv.enabled
        and forwards_token_ids(settings.kv)
    )


def forwards_token_ids(kv: KVAwarenessSettings) -> bool:
    """kv.forward_token_ids as set, else only with the model's own tokenizer (the built-in one's ids
    mean nothing to a real model). Not with "auto": which tokenizer it ends up with is known only
    once a worker answers (it may fall back to the built-in one), so prompts go on as text."""
    if "forward_token_ids" in kv.model_fields_set:
        return kv.forward_token_ids
    return kv.tokenizer not in ("builtin", "auto")
