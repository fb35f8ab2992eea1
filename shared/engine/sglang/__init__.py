"""SGLang as an engine that owns its KV: ``engine.py`` (the worker's engine, on
``sglang.Engine``), ``storage.py`` (kvmesh's storage tier as SGLang's HiCache storage
backend), ``events.py`` (SGLang's KV events as kvmesh's). Nothing here imports SGLang until
an engine starts: a worker without the package refuses ``sglang`` as it starts."""
