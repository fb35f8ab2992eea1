"""Hosting an engine: its loop on a thread of the worker (``runner.py``) or in a process of its
own (``process.py``, speaking ``wire.py``). Above the engine package, which imports nothing
from here."""
