"""LoRA adapters: a PEFT adapter directory read, checked against its base model, and laid out
as the torch engine computes with it.

An adapter directory holds ``adapter_config.json`` (PEFT's LoraConfig) and
``adapter_model.safetensors`` (never a pickled ``adapter_model.bin``). Each linear layer it
targets, W [out, in], gets A [r, in] and B [out, r]: the adapted layer computes
W·x + s·B·A·x, with s = alpha / r (alpha / √r under rsLoRA). The engine fuses the q, k and v
projections into one, and gate and up into one (``shared/engine/torch/weights.py``); an adapter
is fused the same way: a fused projection's A stacks its parts' A ([r_q + r_k + r_v, in]) and
its B puts each part's B, times s, in that part's rows and its own columns (zero elsewhere), so
one low-rank product per fused projection gives every part its own.

An adapter's identity (``digest``) is the hash of both files. It is part of the fingerprint of
the KV the adapter computes (``kv_fingerprint``), so no two adapters, nor an adapter and its
base model, ever share a block, and two requests of one adapter do.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILE = "adapter_model.bin"
NAME_CHARS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")

# A module's place in the engine's fused layout: (projection, its part's index in it).
MODULES = {
    "q_proj": ("wqkv", 0),
    "k_proj": ("wqkv", 1),
    "v_proj": ("wqkv", 2),
    "o_proj": ("wo", 0),
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", 0),
}
PROJECTIONS = ("wqkv", "wo", "w13", "w2")
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


class LoraError(ValueError):
    """An adapter that cannot be served: the message names the file and what is wrong."""


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter as the mesh registers it: the model name it is served as, the base model it
    adapts, the directory it is read from, and its identity (``digest``: both files' hash)."""

    name: str
    base: str
    path: str
    digest: str = ""


def parse_spec(text: str) -> AdapterSpec:
    """``NAME=BASE:PATH`` (``kvmesh up --lora``, ``KVMESH_LORAS``), checked for form only."""
    name, eq, rest = text.partition("=")
    base, colon, path = rest.partition(":")
    if not (eq and colon and name and base and path):
        raise LoraError(f"lora: NAME=BASE:PATH (got {text!r})")
    check_name(name)
    return AdapterSpec(name, base, path)


def check_name(name: str) -> None:
    if not NAME_CHARS.fullmatch(name):
        raise LoraError(
            f"lora name {name!r}: 1 to 128 letters, digits and . _ : / - (a letter or digit first)"
        )


def kv_fingerprint(fingerprint: str, digest: str) -> str:
    """The fingerprint of the KV a model computes under the adapter ``digest`` ("": none)."""
    return f"{fingerprint}+lora-{digest}" if digest else fingerprint


def digest_of(path: str | Path) -> str:
    """An adapter directory's identity: the hash of its config and its weights."""
    directory = adapter_directory(path)
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            h.update((directory / name).read_bytes())
        except FileNotFoundError:
            raise LoraError(_missing(directory, name)) from None
        except OSError as err:
            raise LoraError(f"{directory / name}: unreadable ({err.strerror})") from None
        h.update(b"\0")
    return h.hexdigest()[:16]


def adapter_directory(path: str | Path) -> Path:
    """``path`` as a directory path (LoraError for one no file system takes)."""
    text = str(path)
    if not text or "\0" in text or len(text) > 4096:
        raise LoraError(f"{text[:80]!r}: not a directory path")
    return Path(text)


def _missing(directory: Path, name: str) -> str:
    if name == WEIGHTS_FILE and (directory / PICKLED_FILE).exists():
        return (
            f"{directory / PICKLED_FILE}: a pickled adapter is never read; save it as "
            f"{WEIGHTS_FILE} (PEFT's save_pretrained(safe_serialization=True))"
        )
    if not directory.is_dir():
        return f"{directory}: no such adapter directory"
    return (
        f"{directory / name}: missing (a PEFT adapter directory has {CONFIG_FILE} and "
        f"{WEIGHTS_FILE})"
    )


@dataclass(frozen=True)
class LoraConfig:
    """What of PEFT's LoraConfig kvmesh computes with."""

    r: int
    alpha: float
    rslora: bool
    targets: frozenset[str]  # module names (q_proj, ...)

    def scale(self, rank: int) -> float:
        return self.alpha / (math.sqrt(rank) if self.rslora else rank)


def read_config(directory: Path) -> LoraConfig:
    path = adapter_directory(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoraError(_missing(directory, CONFIG_FILE)) from None
    except OSError as err:
        raise LoraError(f"{path}: unreadable ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LoraError(f"{path}: not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise LoraError(f"{path}: a JSON object expected")

    def refuse(field: str, why: str) -> LoraError:
        return LoraError(f"{path}: {field}: {why}")

    if raw.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"{raw.get('peft_type')!r}; only LORA adapters are served")
    unsupported = {
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "Conv1D-style (fan_in_fan_out) adapters are not supported",
        "modules_to_save": "modules trained whole (modules_to_save) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "use_qalora": "QALoRA adapters are not supported",
        "trainable_token_indices": "trainable tokens are not supported",
    }
    for field, why in unsupported.items():
        if raw.get(field):
            raise refuse(field, why)
    if raw.get("bias", "none") != "none":
        raise refuse("bias", f"{raw['bias']!r}: adapters with biases are not supported")
    r = raw.get("r")
    if not isinstance(r, int) or r < 1:
        raise refuse("r", f"a rank of 1 or more expected (got {r!r})")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, int | float):
        raise refuse("lora_alpha", f"a number expected (got {alpha!r})")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):  # PEFT's regex form: matched against each module's full name
        pattern = re.compile(targets)
        names = {
            m
            for m in MODULES
            if pattern.fullmatch(f"model.layers.0.self_attn.{m}")
            or pattern.fullmatch(f"model.layers.0.mlp.{m}")
        }
    else:
        names = set(targets)
    wrong = sorted(names - set(MODULES))
    if wrong:
        raise refuse(
            "target_modules",
            f"{', '.join(wrong)} not supported (kvmesh adapts {', '.join(MODULES)})",
        )
    if not names:
        raise refuse("target_modules", "none of q/k/v/o/gate/up/down_proj targeted")
    return LoraConfig(r, float(alpha), bool(raw.get("use_rslora")), frozenset(names))


def _module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """A module's weight shape [out, in] in the base model."""
    q_dim = config.n_heads * config.head_dim
    return {
        "q_proj": (q_dim, config.dim),
        "k_proj": (config.kv_dim, config.dim),
        "v_proj": (config.kv_dim, config.dim),
        "o_proj": (config.dim, q_dim),
        "gate_proj": (config.ffn_dim, config.dim),
        "up_proj": (config.ffn_dim, config.dim),
        "down_proj": (config.dim, config.ffn_dim),
    }[module]


def _parts(config: ModelConfig, projection: str) -> list[tuple[str, int]]:
    """A fused projection's modules with each one's first row in it."""
    q_dim = config.n_heads * config.head_dim
    return {
        "wqkv": [("q_proj", 0), ("k_proj", q_dim), ("v_proj", q_dim + config.kv_dim)],
        "wo": [("o_proj", 0)],
        "w13": [("gate_proj", 0), ("up_proj", config.ffn_dim)],
        "w2": [("down_proj", 0)],
    }[projection]


def projection_shape(config: ModelConfig, projection: str) -> tuple[int, int]:
    """A fused projection's weight shape [out, in]."""
    parts = _parts(config, projection)
    out = sum(_module_shape(config, m)[0] for m, _ in parts)
    return out, _module_shape(config, parts[0][0])[1]


@dataclass(frozen=True)
class Adapter:
    """An adapter in the engine's fused layout: for each (layer, projection) it adapts, A
    [R, in] and B [out, R] with its scale in B (R: the ranks of the parts it targets, summed)."""

    digest: str
    rank: int  # the largest of its modules' ranks
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def fused_rank(self, projection: str) -> int:
        return max(
            (a.shape[0] for (_, p), (a, _) in self.weights.items() if p == projection), default=0
        )

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


@dataclass(frozen=True)
class Checked:
    """An adapter directory checked against its base: its config, each (layer, module)'s
    rank, and its identity."""

    directory: Path
    lora: LoraConfig
    ranks: dict[tuple[int, str], int]
    digest: str

    @property
    def rank(self) -> int:
        return max(self.ranks.values())


def check_adapter(path: str | Path, config: ModelConfig, max_rank: int = 0) -> Checked:
    """The adapter at ``path`` checked against the base ``config`` from its files' headers
    (no tensor read): its targets, every tensor's name and shape, its rank against
    ``max_rank`` when set. LoraError, naming the file and the mismatch, otherwise."""
    directory = adapter_directory(path)
    lora = read_config(directory)
    digest = digest_of(directory)
    file = directory / WEIGHTS_FILE
    found: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, shape in _shapes(file).items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise LoraError(f"{file}: tensor {key} is not a q/k/v/o/gate/up/down LoRA A or B")
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in lora.targets:
            raise LoraError(f"{file}: tensor {key}: {module} is not in the config's target_modules")
        if layer >= config.n_layers:
            raise LoraError(
                f"{file}: tensor {key}: layer {layer}, but {config.name} has "
                f"{config.n_layers} layers"
            )
        if module in ("gate_proj", "up_proj", "down_proj") and config.is_moe(layer):
            raise LoraError(f"{file}: tensor {key}: layer {layer}'s MLP is a mixture of experts")
        found.setdefault((layer, module), {})[which] = shape
    if not found:
        raise LoraError(f"{file}: no LoRA tensors")
    ranks: dict[tuple[int, str], int] = {}
    for (layer, module), ab in sorted(found.items()):
        where = f"{file}: layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{where}: lora_{'B' if 'A' in ab else 'A'} is missing")
        out, in_ = _module_shape(config, module)
        a, b = ab["A"], ab["B"]
        if len(a) != 2 or len(b) != 2 or a[1] != in_ or b != [out, a[0]]:
            raise LoraError(
                f"{where}: lora_A {tuple(a)} and lora_B {tuple(b)} do not fit "
                f"{config.name}'s {module} [{out}, {in_}] (A [r, {in_}], B [{out}, r] expected)"
            )
        if max_rank and a[0] > max_rank:
            raise LoraError(
                f"{where}: rank {a[0]} is over the worker's max_lora_rank of {max_rank}"
            )
        ranks[(layer, module)] = a[0]
    return Checked(directory, lora, ranks, digest)


def check_spec(spec: AdapterSpec, config: ModelConfig, max_rank: int = 0) -> Checked:
    """``check_adapter`` of a registered adapter, whose files must be those it was registered
    with (its digest, when the registry gives one)."""
    checked = check_adapter(spec.path, config, max_rank)
    if spec.digest and checked.digest != spec.digest:
        raise LoraError(
            f"{spec.path}: its files are not those registered as {spec.name!r} (digest "
            f"{checked.digest}, registered {spec.digest}): the same path on every host?"
        )
    return checked


MAX_HEADER = 100 << 20


def _shapes(file: Path) -> dict[str, list[int]]:
    """Each tensor's shape, from a safetensors file's header."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= MAX_HEADER:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except FileNotFoundError:
        raise LoraError(_missing(file.parent, file.name)) from None
    except OSError as err:
        raise LoraError(f"{file}: unreadable ({err.strerror})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise LoraError(f"{file}: not a safetensors file ({err})") from None


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int = 0) -> Adapter:
    """The adapter at ``path``, checked (``check_adapter``), in the engine's fused layout."""
    import torch
    from safetensors import SafetensorError, safe_open

    checked = check_adapter(path, config, max_rank)
    file = checked.directory / WEIGHTS_FILE
    tensors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _KEY.fullmatch(key)
                assert m is not None  # (checked)
                tensors.setdefault((int(m[1]), m[2]), {})[m[3]] = f.get_tensor(key).float()
    except SafetensorError as err:
        raise LoraError(f"{file}: not a safetensors file ({err})") from None
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in sorted({layer for layer, _ in tensors}):
        for projection in PROJECTIONS:
            parts = [(m, row) for m, row in _parts(config, projection) if (layer, m) in tensors]
            if not parts:
                continue
            out, _ = projection_shape(config, projection)
            a = torch.cat([tensors[(layer, m)]["A"] for m, _ in parts])  # [R, in]
            b = torch.zeros(out, a.shape[0])
            col = 0
            for m, row in parts:
                part = tensors[(layer, m)]["B"] * checked.lora.scale(checked.ranks[(layer, m)])
                b[row : row + part.shape[0], col : col + part.shape[1]] = part
                col += part.shape[1]
            weights[(layer, projection)] = (a.contiguous(), b)
    return Adapter(checked.digest, checked.rank, weights)
