"""Traces (OpenTelemetry) and metrics (Prometheus) of every service."""
