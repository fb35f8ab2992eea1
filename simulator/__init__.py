"""The trace simulator: replays traces through the router's routing policies and cachemeta's
block index (their pure code, deliberately reused) against simulated workers. The one part that
imports two services; `kvmesh sim` and bench/routing.py drive it."""
