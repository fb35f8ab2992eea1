"""The prefill worker: turns a prompt into KV and hands it to a decode worker."""
