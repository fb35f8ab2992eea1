"""vLLM as an engine that owns its KV (``shared.engine.interface.OwningEngine``), from the
``vllm`` extra; imported only when a worker's ``KVMESH_<WORKER>_ENGINE`` is ``vllm``."""
