"""The request, format-free. Takes a ``Conversation`` (from any format's adapter) and gives a
``Prepared`` request (checked, rendered to token ids, its job made: ``prepare.py``) and its
answer as text deltas (``answer.py``): images read and checked, the one renderer, the
detokenizer, tool calls parsed out of the answer's text."""
