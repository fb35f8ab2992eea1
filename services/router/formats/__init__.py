"""Formats: each API's adapter and writer. Takes a request body and gives a ``Conversation``
(or a 400 naming the field); takes a prepared request's answer deltas and gives the bytes of
that API's body or stream, and its error bodies. Pure: no transport, no workers. One table
(``endpoints.py``) lists every generation endpoint with its adapter and writer."""
