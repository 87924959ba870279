"""Write a tiny random Llama model and its tokenizer to a directory, for real vLLM engines to serve.

Run under the vLLM venv's Python (torch and transformers live only there):
    python make_tiny_model.py OUT_DIR

Nothing is downloaded: the weights are random (seeded, so every run writes the same model) and the
tokenizer is a WordLevel vocabulary built here. The words are the 26 letters and w0..w479, split on
whitespace, so a test writes prompts of exactly known token counts ("a b c" is BOS + 3 tokens).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_SIZE = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
# A plain template (no whitespace control) so that jinja2 with trim_blocks/lstrip_blocks (vLLM via
# transformers, and the gateway's own renderer) produces the same text as without them.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def vocabulary() -> dict[str, int]:
    words = SPECIALS + LETTERS
    words += [f"w{i}" for i in range(VOCAB_SIZE - len(words))]
    assert len(words) == VOCAB_SIZE
    return {w: i for i, w in enumerate(words)}


def write_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = vocabulary()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # a text prompt gets BOS in front, as Llama tokenizers do (vLLM encodes completions prompts with
    # special tokens; chat prompts carry BOS through the template instead)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    # WordLevel has no decoder of its own; this one joins the words back with spaces
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2)
    )


def write_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        # Wider than the usual 0.02: random weights that small give logits so close together that
        # bf16 rounding differences between two code paths (cached vs computed prefix, P/D vs one
        # engine) could flip a greedy choice; spread out, the argmax is robust and the comparisons
        # in the tests are about the serving path, not about rounding.
        initializer_range=0.5,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    write_model(out)
    print(out)


if __name__ == "__main__":
    main()
