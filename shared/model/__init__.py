"""A model's text side, without weights or torch: its configuration (from the GGUF file's
metadata, or a tiny seeded config), its tokenizer and chat template, and their cache. The
router needs only this; workers load weights on top of it (``shared/engine``)."""
