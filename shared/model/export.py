"""A GGUF model written as a Hugging Face directory, for the engines that take those (vLLM,
SGLang, transformers): ``config.json``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template), ``special_tokens_map.json`` and
``model.safetensors``. The weights are the file's, dequantized (and llama.cpp's q/k rows put
back in the half-split rope layout), in fp32 or fp16. No torch: numpy and safetensors.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from shared.files import locked
from shared.model import gguf
from shared.model.catalog import ModelError, ModelSource
from shared.model.config import ModelConfig
from shared.model.text import text_of

log = logging.getLogger(__name__)

CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
DTYPES = {"float32": np.float32, "float16": np.float16}


def hf_config(config: ModelConfig, dtype: str) -> dict:
    """``config.json`` (transformers' keys; rope as ``rope_theta`` and ``rope_scaling``,
    which every version reads)."""
    out = {
        "architectures": [CLASSES[config.arch]],
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_context,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": config.bos_id,
        "eos_token_id": list(config.eos_ids) if len(config.eos_ids) > 1 else config.eos_ids[0],
        "torch_dtype": dtype,
    }
    if config.arch == "mistral":
        out["sliding_window"] = config.sliding_window
    s = config.rope_scaling
    if s is not None:
        out["rope_scaling"] = (
            {"rope_type": "linear", "factor": s.factor}
            if s.kind == "linear"
            else {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_context,
            }
        )
    return out


def _exportable(source: ModelSource, config: ModelConfig) -> None:
    if source.kind not in ("bundled", "gguf"):
        raise ModelError(
            f"{source.where()}: only a GGUF model is exported (this one is {source.kind})"
        )
    if config.moe is not None or (config.swa_layers and config.arch != "mistral"):
        raise ModelError(f"{source.name}: its layers have no Hugging Face architecture")
    if config.rope_scaling is not None and config.rope_scaling.kind == "factors":
        raise ModelError(
            f"{source.where()}: its rope frequencies come as a tensor, which config.json cannot say"
        )


def export(source: ModelSource, state_dir: Path, to: Path, dtype: str = "float32") -> Path:
    """Write the model as a Hugging Face directory at ``to`` (made if missing)."""
    if dtype not in DTYPES:
        raise ModelError(f"--dtype: one of {', '.join(DTYPES)} (got {dtype!r})")
    started = time.monotonic()
    text = text_of(source, state_dir)
    config = text.config
    _exportable(source, config)
    path = gguf.find_gguf() if source.kind == "bundled" else source.path
    assert path is not None
    to.mkdir(parents=True, exist_ok=True)
    tensors = _tensors(path, config, DTYPES[dtype])
    from safetensors.numpy import save_file

    save_file(tensors, str(to / "model.safetensors"), metadata={"format": "pt"})
    (to / "model.safetensors").chmod(0o644)  # (safetensors writes it owner-only)
    (to / "config.json").write_text(json.dumps(hf_config(config, dtype), indent=2))
    generation = {"bos_token_id": config.bos_id, "eos_token_id": list(config.eos_ids)}
    (to / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (to / "tokenizer.json").write_text(text.tokenizer.to_str())
    template = text.chat_template
    special = {"bos_token": template.bos, "eos_token": template.eos}
    tokenizer_config = {
        **special,
        "chat_template": template.source,
        "model_max_length": config.max_context,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    (to / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (to / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    log.info("exported %s to %s in %.1f s", source.name, to, time.monotonic() - started)
    return to


def _tensors(path: Path, config: ModelConfig, dtype: type) -> dict[str, np.ndarray]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in gguf.reader(path).tensors:
        name = gguf.hf_name(t.name)
        if name is None:
            continue
        x = dequantize(t.data, GGMLQuantizationType(t.tensor_type)).astype(np.float32, copy=False)
        if gguf.permuted(config, name):
            heads = config.n_heads if "q_proj" in name else config.n_kv_heads
            x = gguf.unpermute_rope(x, heads)
        out[name] = np.ascontiguousarray(x, dtype=dtype)
    return out


def hf_directory(source: ModelSource, config: ModelConfig, state_dir: Path) -> Path:
    """The model as a Hugging Face directory: its own, or a GGUF model's export (made once
    per machine, under a lock when workers start together)."""
    if source.kind == "hf":
        assert source.path is not None
        return source.path
    to = state_dir / "cache" / f"hf-{config.fingerprint}"
    with locked(to.with_suffix(".lock")):
        if not (to / "config.json").is_file():
            export(source, state_dir, to)
    return to
