"""KV blocks beyond one engine: their identity (hashing), where they are kept (backends), and
a worker's view of its tiers (memory, storage, write-behind, events)."""
