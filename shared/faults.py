"""Faults a test switches on inside a running process, by name: the code that can fail that
way checks for its name. Off unless the process runs with KVMESH_FAULT_HOOKS=true, which
serves ``PUT``/``DELETE /faults/{name}`` (never set in production: the route has no auth).

Names in use: ``kv_events`` (the worker's KV events are made but not published, as if NATS
refused them); ``kv_feed`` (a vLLM worker's engine cache events are dropped as they come, as
if its feed went quiet); ``engine_step`` (a decode step raises); ``engine_prefill`` (a prompt's
compute raises, on a prefill worker or decode's local prefill); ``poison_token_<id>`` (an
engine call on a prompt holding that token id raises: its prefill, or a decode step while it
is in the batch: a request that makes every engine fail); ``token_links`` (a router closes
its workers' token links and takes none: shared/bus/tokens.py). A process that runs part of
itself elsewhere (decode's engine process) passes the switches on (``LISTENERS``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

ACTIVE: set[str] = set()
LISTENERS: list[Callable[[set[str]], None]] = []  # told of every switch


POISON = "poison_token_"


def on(name: str) -> bool:
    return name in ACTIVE


def poisoned(prompts: Iterable[Sequence[int]]) -> bool:
    """Whether one of the prompts holds a token a ``poison_token_<id>`` fault names."""
    if not ACTIVE:
        return False
    tokens = {int(name.removeprefix(POISON)) for name in ACTIVE if name.startswith(POISON)}
    return bool(tokens) and any(not tokens.isdisjoint(ids) for ids in prompts)


def switch(name: str, active: bool) -> list[str]:
    """Turn the fault ``name`` on or off, every listener told; the faults on now. (Served as
    ``PUT``/``DELETE /faults/{name}`` by ``shared.service``: this module imports no HTTP
    library, for the engine's process that only reads the switches.)"""
    if active:
        ACTIVE.add(name)
    else:
        ACTIVE.discard(name)
    for listener in LISTENERS:
        listener(set(ACTIVE))
    return sorted(ACTIVE)
