"""Cache metadata: where every KV block lives, retention, eviction and GC."""
