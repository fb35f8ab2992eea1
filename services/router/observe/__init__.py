"""Observe: what the router records of its requests. Takes each request as it is handled and
gives its span, log line, metrics and statistics (``recorder.py``), the mesh's figures as
DeepInfer publishes them, shared between routers (``stats.py``, ``sharing.py``), and why a
prompt missed the cache, said in its response (``cachemiss.py``)."""
