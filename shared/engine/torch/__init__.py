"""The torch backend: our own Llama-family model over a paged KV cache (CPU or CUDA)."""
