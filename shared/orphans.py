"""No orphans: a process that must not outlive the one that started it asks the kernel for
SIGKILL when its parent dies (Linux's PR_SET_PDEATHSIG), so even a parent killed with
SIGKILL, which can clean nothing up, leaves nothing running."""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import os
import signal
import sys
from pathlib import Path

from shared.files import replacing


def die_with_parent() -> None:
    """Run in the child (before exec, or first thing in a Python child)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


LAUNCHER = """#!{python}
# Written by kvmesh (shared/orphans.py): starts a Python child that dies with its parent.
import os, sys
from shared.orphans import die_with_parent
die_with_parent()
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
"""


def spawned_children_die_with_us(state_dir: Path) -> None:
    """Python children started by multiprocessing's "spawn" (vLLM's engine core) get SIGKILL
    when this process dies: they are started through a launcher that asks for it, then runs
    this interpreter (the request outlives the exec). Forked children ask for it themselves."""
    text = LAUNCHER.format(python=sys.executable)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]  # one per interpreter
    launcher = state_dir / "bin" / f"python-child-{digest}"
    if not launcher.is_file():
        launcher.parent.mkdir(parents=True, exist_ok=True)
        with replacing(launcher) as tmp:  # workers starting together each write theirs
            tmp.write_text(text)
            tmp.chmod(0o700)
    multiprocessing.set_executable(str(launcher))
    os.register_at_fork(after_in_child=die_with_parent)
