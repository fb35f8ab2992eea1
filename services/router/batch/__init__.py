"""Batch work: OpenAI's Files and Batches API. Takes uploaded files of requests and gives
their answers as files: the endpoints (``api.py``), the files in a JetStream object store
(``files.py``), batches' durable records and results (``store.py``), their input lines and the
order that reuses prefixes (``lines.py``), and the runner any router uses to carry a batch on
(``runner.py``), its lines answered after online requests."""
