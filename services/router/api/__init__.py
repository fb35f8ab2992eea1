"""The transports, bytes in and out: the HTTP API's generation endpoints (``http.py``) and the
gRPC API (``grpc.py``), the operator's endpoints (health, models, stats, the OpenAPI document)
and page (``dashboard.py``); around every route one envelope (``middleware.py``) that gives the
request its id, its record, its caller and admission, and renders its errors in its API's
shape."""
