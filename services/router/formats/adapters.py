"""The operator's LoRA bodies, in vLLM's names: loading an adapter (its name, its PEFT
directory, the base model it adapts) and unloading one; a 400 names the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from shared.model.lora import NAME_CHARS


class LoadAdapter(BaseModel):
    """POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(
        pattern=f"^{NAME_CHARS.pattern}$", description="the model name it is served as"
    )
    lora_path: str = Field(
        min_length=1,
        max_length=4096,
        description="its PEFT directory (adapter_config.json, adapter_model.safetensors), at "
        "the same path on every worker's host",
    )
    base_model: str | None = Field(
        default=None, description="the model it adapts; unset: the one model served"
    )


class UnloadAdapter(BaseModel):
    """POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
