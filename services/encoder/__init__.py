"""The vision encoder: images to embeddings, cached by content hash."""
