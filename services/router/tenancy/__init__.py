"""Tenancy: who a request is and what it may send. Takes a request's headers (or gRPC
metadata) and gives its caller (the API key's tenant), its admission (the router's bounds and
the key's limits: 429 when over) and its KV options (retention class, the tenant's salt)."""
