"""Routing: pure and synchronous. Takes a request's size, its blocks' hashes and where the index
says they are, and the candidate workers with their load; gives the workers to try, best first,
with the terms that placed them (``route.route``). The live router and `kvmesh sim` run the same
code; it imports no asyncio, NATS or gRPC."""
