"""Every NATS subject kvmesh uses, in one place.

Subjects are dot-separated and start with ``kvmesh.``; the last token of a per-role or
per-request subject is filled in by the functions here, never by string formatting elsewhere.
"""

from __future__ import annotations

PREFIX = "kvmesh"

# Heartbeats and load reports: every service publishes on heartbeat(role) every interval.
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.>"


def heartbeat(role: str) -> str:
    return f"{PREFIX}.heartbeat.{role}"


# Request/reply: a router's view of the live workers (served by every router, queue group).
ROUTER_REGISTRY = f"{PREFIX}.router.registry"
ROUTER_QUEUE = "router"
