"""Who may use the mesh: API keys (later: bus credentials, TLS material)."""
