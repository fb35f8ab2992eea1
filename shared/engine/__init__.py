"""The compute engine boundary (``interface.py``), its backends by name (``registry.py``), the
KV block format (``kvformat.py``), and the torch backend (``torch/``)."""
