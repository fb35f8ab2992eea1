"""The router: the front door (HTTP and gRPC APIs) and the registry of live services."""
