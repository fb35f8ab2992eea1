"""The mesh's secrets: 32 random bytes each, one file each in the secrets dir (mode 0600), made
by whichever process needs one first. Every router and worker of a mesh must read the same
files: `kvmesh up` and docker-compose give them one state dir; elsewhere, KVMESH_SECRETS_DIR."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

SECRET_BYTES = 32


def load_or_create(secrets_dir: Path, name: str) -> bytes:
    """The secret ``name``, made now if there is none (processes starting at once agree on
    one: the first to create the file wins, the others read it)."""
    path = secrets_dir / f"{name}.key"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(100):  # the creator may still be writing
            data = path.read_bytes()
            if len(data) == SECRET_BYTES:
                return data
            time.sleep(0.01)
        raise ValueError(f"{path}: not a {SECRET_BYTES}-byte secret") from None
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    return secret
