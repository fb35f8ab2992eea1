"""The compute engine: a Llama-family model over a paged KV cache, behind ``Engine``."""
