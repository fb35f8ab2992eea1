"""Tiny LoRA adapters for tests, made by the test itself with PEFT (random weights: B is not
zero, so an adapter changes what the model computes) on a transformers model, saved as PEFT
saves them (``adapter_config.json`` and ``adapter_model.safetensors``)."""

from __future__ import annotations

from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(  # noqa: ANN201
    base,  # noqa: ANN001 (a transformers model)
    directory: Path,
    seed: int,
    r: int = 4,
    targets: list[str] | None = None,
    alpha: float = 8.0,
    rslora: bool = False,
    rank_pattern: dict | None = None,
):
    """A random LoRA adapter on ``base`` saved to ``directory``; the PEFT model computing
    with it (a copy of ``base`` under the adapter: ``base`` is left as it was)."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL,
        init_lora_weights=False,  # (random B: PEFT's default would start it at zero)
        use_rslora=rslora,
        rank_pattern=rank_pattern or {},
        lora_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():  # (large enough to change the greedy tokens of a random model)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def tiny_shaped_base():  # noqa: ANN201
    """A transformers model shaped as kvmesh's tiny model (what an adapter of it must fit)."""
    import transformers

    from shared.model.config import TINY_CONFIGS

    c = TINY_CONFIGS["tiny"]
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()
