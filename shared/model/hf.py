"""A Hugging Face model directory's text side, as the router and the workers read it (no torch):
``config.json`` as a ``ModelConfig``, ``tokenizer.json``, the chat template
(``tokenizer_config.json``'s ``chat_template``, or ``chat_template.jinja``/``.json`` beside it),
the special tokens, and the EOS ids (``generation_config.json`` too). The weights are the
torch engine's (``shared/engine/torch/weights.py``).

Supported: the Llama family as transformers defines it, ``LlamaForCausalLM`` (Llama 2 and 3.x,
SmolLM, TinyLlama; rope scaling ``llama3`` or ``linear``), ``MistralForCausalLM`` (a sliding
window on every layer), ``Qwen2ForCausalLM`` (biases on q, k and v), ``Qwen3ForCausalLM``
(RMSNorm of each head's q and k); SiLU-gated MLPs; weights in bf16, fp16 or fp32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from shared.model.catalog import ModelError, ModelSource
from shared.model.config import ModelConfig, RopeScaling

ARCHITECTURES = {  # transformers' class → ours
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPES = ("bfloat16", "float16", "float32")
ROPE_KINDS = ("default", "linear", "llama3")


def read_json(path: Path, source: ModelSource) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelError(f"{source.where()}: {path.name} cannot be read: {err}") from None


def architecture(config: dict[str, Any], source: ModelSource) -> str:
    named = config.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in named if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelError(
            f"{source.where()}: architecture {', '.join(named) or config.get('model_type')!r} "
            f"is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def _refuse(source: ModelSource, what: str, supported: str = "") -> None:
    also = f" (supported: {supported})" if supported else ""
    raise ModelError(f"{source.where()}: config.json: {what} is not supported{also}")


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings: transformers 4's ``rope_theta`` and ``rope_scaling``, or 5's
    ``rope_parameters`` (the theta inside)."""
    return {
        "rope_theta": config.get("rope_theta", 10000.0),
        **(config.get("rope_scaling") or {}),
        **(config.get("rope_parameters") or {}),
    }


def _rope_scaling(config: dict[str, Any], source: ModelSource) -> RopeScaling | None:
    scaling = _rope(config)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ROPE_KINDS:
        _refuse(source, f"rope_scaling {kind!r}", ", ".join(ROPE_KINDS))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(scaling["factor"]))
    return RopeScaling(
        "llama3",
        float(scaling["factor"]),
        float(scaling.get("low_freq_factor", 1.0)),
        float(scaling.get("high_freq_factor", 4.0)),
        int(scaling.get("original_max_position_embeddings", 8192)),
    )


def eos_ids(directory: Path, config: dict[str, Any], source: ModelSource) -> tuple[int, ...]:
    """Every id that ends an answer: config.json's and generation_config.json's."""
    found: list[int] = []
    generation = directory / "generation_config.json"
    extra = read_json(generation, source) if generation.is_file() else {}
    for d in (config, extra):
        value = d.get("eos_token_id")
        found += [value] if isinstance(value, int) else list(value or [])
    if not found:
        raise ModelError(f"{source.where()}: no eos_token_id in config.json")
    return tuple(dict.fromkeys(found))


def read_config(source: ModelSource, weights_id: str) -> ModelConfig:
    """The directory's ``config.json`` as a ModelConfig (ModelError for what is not served)."""
    assert source.path is not None
    c = read_json(source.path / "config.json", source)
    arch = architecture(c, source)
    if c.get("hidden_act", "silu") != "silu":
        _refuse(source, f"hidden_act {c['hidden_act']!r}", "silu")
    if c.get("mlp_bias"):
        _refuse(source, "mlp_bias")
    if c.get("attention_bias") and arch != "qwen2":  # (Qwen2's q, k, v biases are its own)
        _refuse(source, "attention_bias (an output projection with a bias)")
    if c.get("use_sliding_window") and arch in ("qwen2", "qwen3"):
        _refuse(source, "use_sliding_window")
    n_layers, n_heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    window = int(c.get("sliding_window") or 0) if arch == "mistral" else 0
    return ModelConfig(
        name=source.name,
        vocab_size=int(c["vocab_size"]),
        dim=int(c["hidden_size"]),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // n_heads),
        ffn_dim=int(c["intermediate_size"]),
        rope_theta=float(_rope(c)["rope_theta"]),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_context=int(c.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        sliding_window=window,
        swa_layers=tuple(range(n_layers)) if window else (),
        bos_id=int(c.get("bos_token_id") or 0),
        eos_ids=eos_ids(source.path, c, source),
        arch=arch,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        rope_scaling=_rope_scaling(c, source),
        weights_id=weights_id,
    )


def read_tokenizer(source: ModelSource) -> Tokenizer:
    assert source.path is not None
    path = source.path / "tokenizer.json"
    if not path.is_file():
        raise ModelError(f"{source.where()}: no tokenizer.json (a tokenizers-library file)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 (the library's own errors, as a message)
        raise ModelError(f"{source.where()}: tokenizer.json cannot be read: {err}") from None


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def read_template(source: ModelSource) -> tuple[str, str, str]:
    """The chat template, and the BOS and EOS texts it is rendered with."""
    assert source.path is not None
    d = source.path
    config_file = d / "tokenizer_config.json"
    tc = read_json(config_file, source) if config_file.is_file() else {}
    template = tc.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if not template and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    if not template and (d / "chat_template.json").is_file():
        template = read_json(d / "chat_template.json", source).get("chat_template")
    if not template:
        raise ModelError(
            f"{source.where()}: no chat template (tokenizer_config.json's chat_template, or "
            "chat_template.jinja): kvmesh renders every conversation with the model's own"
        )
    return template, _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))


def weight_files(source: ModelSource) -> list[Path]:
    """The directory's safetensors files (every shard), in order."""
    assert source.path is not None
    files = sorted(source.path.glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"{source.where()}: no *.safetensors weights (kvmesh reads safetensors only, "
            "never pickled .bin files)"
        )
    return files
