"""Expert load statistics: tokens routed per layer and expert, summed over windows of steps,
the last few windows kept; and load files (per-step counts) recorded and read back."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLES = 16  # steps a window keeps whole (for the planner's scenarios)


@dataclass(frozen=True)
class Window:
    """One window's load: per layer and expert, the sum of per-step token counts and of their
    squares (so the per-step noise is known, not just the mean)."""

    steps: int
    total: np.ndarray  # [layers, experts]
    squares: np.ndarray  # [layers, experts]
    peak: np.ndarray  # [layers, experts]: the most tokens in one step
    samples: np.ndarray  # [n, layers, experts]: some of its steps' counts, evenly spaced

    @property
    def mean(self) -> np.ndarray:
        return self.total / self.steps

    @property
    def var(self) -> np.ndarray:
        return np.maximum(self.squares / self.steps - self.mean**2, 0.0)

    @classmethod
    def of(cls, counts: np.ndarray) -> Window:
        """From per-step counts [steps, layers, experts]."""
        counts = np.asarray(counts, dtype=np.float64)
        every = max(1, len(counts) // SAMPLES)
        return cls(
            len(counts), counts.sum(0), (counts**2).sum(0), counts.max(0), counts[::every][:SAMPLES]
        )


class LoadWindows:
    """Per-step counts in, completed windows out (the last ``keep``)."""

    def __init__(self, layers: int, experts: int, window_steps: int, keep: int = 48) -> None:
        self.window_steps = window_steps
        self.windows: deque[Window] = deque(maxlen=keep)
        self.steps = 0  # steps counted, all windows
        self._total = np.zeros((layers, experts))
        self._squares = np.zeros((layers, experts))
        self._peak = np.zeros((layers, experts))
        self._samples: list[np.ndarray] = []
        self._in_window = 0

    def add(self, counts: np.ndarray) -> bool:
        """One step's counts [layers, experts]; True when it completed a window."""
        counts = np.asarray(counts, dtype=np.float64)
        self._total += counts
        self._squares += counts**2
        np.maximum(self._peak, counts, out=self._peak)
        if self._in_window % max(1, self.window_steps // SAMPLES) == 0:
            self._samples.append(counts)
        self._in_window += 1
        self.steps += 1
        if self._in_window < self.window_steps:
            return False
        samples = np.stack(self._samples[:SAMPLES])
        window = Window(self._in_window, self._total, self._squares, self._peak, samples)
        self.windows.append(window)
        self._samples = []
        self._total = np.zeros_like(self._total)
        self._squares = np.zeros_like(self._squares)
        self._peak = np.zeros_like(self._peak)
        self._in_window = 0
        return True

    def last(self) -> Window | None:
        return self.windows[-1] if self.windows else None


def read_load(path: str | Path) -> np.ndarray:
    """Per-step counts [steps, layers, experts] from a load file: JSON ``{"counts": ...}`` (or
    a bare nested list) or NPZ with a ``counts`` array. A [steps, experts] file is one layer."""
    path = Path(path)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as f:
            if "counts" not in f:
                raise ValueError(f"{path}: an NPZ load file needs a 'counts' array")
            counts = f["counts"]
    else:
        data = json.loads(path.read_text())
        counts = np.asarray(data["counts"] if isinstance(data, dict) else data)
    if counts.ndim == 2:
        counts = counts[:, None, :]
    if counts.ndim != 3 or counts.shape[0] == 0:
        raise ValueError(
            f"{path}: counts must be [steps, layers, experts] (or [steps, experts]), "
            f"got shape {list(counts.shape)}"
        )
    if (counts < 0).any():
        raise ValueError(f"{path}: counts must not be negative")
    return counts.astype(np.float64)


def write_load(path: str | Path, counts: np.ndarray) -> None:
    """Per-step counts [steps, layers, experts] to ``path`` (.npz compressed, else JSON)."""
    path = Path(path)
    counts = np.asarray(counts)
    if path.suffix == ".npz":
        np.savez_compressed(path, counts=counts)
    else:
        path.write_text(json.dumps({"counts": counts.tolist()}))
