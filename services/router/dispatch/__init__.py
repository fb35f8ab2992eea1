"""Dispatch: talking to workers. Takes a job (a prompt's tokens, how to sample, its tenant's salt
and retention) and gives its token events in answer order (``Dispatcher.generate``), whatever
befalls its workers: the cache plan, the routing decision sent as a task, the events streamed
back and merged, the watchdog, the moves to other workers; beside them the image encodes, the
registry of workers and their circuit breakers."""
