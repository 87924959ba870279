"""Write a small random LoRA adapter for the tiny model (make_tiny_model.py), in PEFT's format:
    python make_tiny_lora.py BASE_MODEL_DIR OUT_DIR [SEED]

Run under the vLLM venv's Python (torch and safetensors live only there). Nothing is downloaded and
PEFT is not needed: adapter_config.json names the rank, alpha and the attention projections it
adapts; adapter_model.safetensors holds `base_model.model.<module>.lora_A.weight` (rank x in) and
`lora_B.weight` (out x rank) for each of them, as PEFT saves a LlamaForCausalLM's adapter. B is
random rather than PEFT's zeros, so the adapter changes the model's answers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def projection_shapes(config: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adapted projection of a Llama layer with this config."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden)}


def write_adapter(base: Path, out: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    shapes = projection_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        for name in TARGETS:
            fan_in, fan_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=generator) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=generator) * 0.2
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGETS),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


def main() -> None:
    base, out = Path(sys.argv[1]), Path(sys.argv[2])
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    out.mkdir(parents=True, exist_ok=True)
    write_adapter(base, out, seed)
    print(out)


if __name__ == "__main__":
    main()
