"""The NATS control plane: subjects, and typed publish/subscribe/request/JetStream helpers."""

from shared.bus.client import Bus, BusError, RemoteError

__all__ = ["Bus", "BusError", "RemoteError"]
