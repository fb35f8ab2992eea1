"""The NATS control plane: subjects, and typed publish/subscribe/request/JetStream helpers."""

from shared.bus.client import Bus, BusError, NoReply, NoResponders, RemoteError, riding_out

__all__ = ["Bus", "BusError", "NoReply", "NoResponders", "RemoteError", "riding_out"]
