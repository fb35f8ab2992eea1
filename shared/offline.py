"""Nothing kvmesh starts reports usage or reaches a host it was not configured for.

vLLM reports usage statistics to its authors unless told not to; Hugging Face's libraries send
telemetry and look models up on the Hub. Every kvmesh process (``stay_offline`` first thing in
``run_service``, and the environment ``kvmesh up`` gives its children and the ``vllm serve``
command ``kvmesh model vllm-serve`` prints) turns these off. An operator who wants one on sets
it in the environment: what is set there is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OFFLINE = {
    "VLLM_NO_USAGE_STATS": "1",  # vLLM's usage report
    "DO_NOT_TRACK": "1",  # the convention vLLM and others also read
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_OFFLINE": "1",  # no Hub look-up: kvmesh's models are files on disk
}


def offline_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``OFFLINE``'s values where it sets none."""
    return {**OFFLINE, **env}


def stay_offline() -> None:
    """This process and the ones it starts (vLLM's engine core, say), offline as above."""
    for name, value in OFFLINE.items():
        os.environ.setdefault(name, value)
