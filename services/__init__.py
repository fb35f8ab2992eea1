"""kvmesh's services, one package per role; each runs as `python -m services.<role>`."""
