"""Upstream: servers the router routes to that kvmesh did not start (``vllm serve``, SGLang's
server). Takes their addresses (``upstreams``) and gives them to the mesh as workers: each in
the registry from its own ``/metrics``, its prefix cache in the router's index from its own KV
events, and the dispatcher's tasks to it made as HTTP calls whose tokens come back as a
worker's (``Upstreams`` is the dispatcher's ``Direct``)."""
