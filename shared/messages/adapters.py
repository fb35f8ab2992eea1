"""The LoRA adapters stream's message (``subjects.LORAS_STREAM``): an adapter loaded at run
time, or unloaded (the last message per name is what holds)."""

from __future__ import annotations

from pydantic import Field

from shared.messages import Message
from shared.model.lora import AdapterSpec


class AdapterRecord(Message):
    name: str
    base: str = Field(description="the model it adapts")
    path: str = Field(description="its PEFT directory, the same path on every host")
    digest: str = Field(description="the hash of its two files (shared/model/lora.py)")
    loaded: bool = Field(default=True, description="False: unloaded")
    by: str = Field(default="", description="the router that wrote it")

    @classmethod
    def of(cls, spec: AdapterSpec, by: str, loaded: bool = True) -> AdapterRecord:
        return cls(
            name=spec.name, base=spec.base, path=spec.path, digest=spec.digest, loaded=loaded, by=by
        )

    @property
    def spec(self) -> AdapterSpec:
        return AdapterSpec(self.name, self.base, self.path, self.digest)
