"""The command line of a ``vllm serve`` server that kvmesh's router can route to as well as it
routes its own workers (``services/router/upstream/``): the model as kvmesh exports it (so the
server's tokenizer and chat template are the router's), kvmesh's block size (one hash per
block), its KV cache events published on a bound port with a replay socket beside it (the
router follows them over the network), its token-in-token-out endpoint on (the router sends
token ids and reads token ids, no text made on the server), the cached prompt tokens in its
usage, and, with a storage tier, kvmesh's connector by module
path (turns move between servers through the tier, and the tier's blocks are announced on the
same events). ``kvmesh model vllm-serve`` prints it; the upstream tests start their servers
with it.

vLLM's ``vllm`` console script does not start in the CPU build's distribution (it looks its
own name up), so the command runs its API server module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shared.offline import OFFLINE

BLOCK_SIZE = 32  # vLLM's CPU attention's kernel block sizes are multiples of 32
REPLAY_OFFSET = 1  # the replay socket: the events port + 1


def serve_command(
    directory: Path,
    served_name: str,
    port: int,
    events_port: int,
    fingerprint: str = "",
    store_dir: Path | None = None,
    host: str = "0.0.0.0",
    eager: bool = False,
    dtype: str = "float32",
    python: str = sys.executable,
) -> list[str]:
    """The argv of the server (``store_dir``: kvmesh's storage tier, by its connector; it
    names blocks with the model's ``fingerprint``; ``eager``: no compiled graphs, answers
    equal across runs and a start in seconds, as kvmesh's own vLLM workers run on CPUs;
    ``dtype``: the weights' and KV's, always said: vLLM's ``auto`` turns a float32 model into
    bfloat16 where the CPU has bf16 instructions, so the same command would answer
    differently, and slower, from one CPU to the next; on a GPU, ``bfloat16``)."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{events_port + REPLAY_OFFSET}",
        "topic": "",
    }
    argv = [
        "env",  # (no usage report, no Hub look-up: shared/offline.py)
        *(f"{name}={value}" for name, value in OFFLINE.items()),
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(directory),
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--block-size",
        str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enable-scale-out",
        "--kv-events-config",
        json.dumps(events),
    ]
    if eager:
        argv.append("--enforce-eager")
    if store_dir is not None:
        connector = {
            "kv_connector": "KvmeshStorageConnector",
            "kv_connector_module_path": "shared.engine.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store_dir": str(store_dir), "fingerprint": fingerprint},
        }
        argv += ["--kv-transfer-config", json.dumps(connector)]
    return argv
