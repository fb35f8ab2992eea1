"""A real small file system for storage-tier faults: a tmpfs of a few KiB that fills, remounted
read-only on cue. Needs root (CI runs as root); elsewhere the tests that use it are skipped,
saying so."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size_kib: int) -> Iterator[Path]:
    """A tmpfs of ``size_kib`` mounted at ``path`` (made here) for the block, unmounted after
    whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, mode: str) -> None:
    """The tmpfs at ``path`` made read-only (``ro``) or writable again (``rw``)."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)
