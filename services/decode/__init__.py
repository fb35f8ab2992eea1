"""The decode worker: turns KV into tokens with continuous batching."""
