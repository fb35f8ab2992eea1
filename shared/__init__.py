"""What two or more kvmesh services need: settings, wire messages, the NATS bus, lifecycle."""

__version__ = "0.1.0"
