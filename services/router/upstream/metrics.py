"""What a server says of itself on its Prometheus ``/metrics``, read the same from vLLM's and
SGLang's names: requests running and waiting, its KV cache (block size, blocks, share used),
the prompt tokens it has taken and of those the ones its prefix cache held, and when its
process started (a restarted server is a new process: its cache and its event feed start
over)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Each figure's name in each engine's metrics (vLLM's first).
NAMES = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "sglang:token_usage"),
    "prompt_tokens": ("vllm:prompt_tokens", "sglang:prompt_tokens"),
    "cached_tokens": ("vllm:prefix_cache_hits", "sglang:cached_tokens"),
    "block_size": ("", "sglang:page_size"),
    "kv_tokens": ("", "sglang:max_total_num_tokens"),
    "started_at": ("process_start_time_seconds",),
}
# Each figure's sample names: a counter's samples end in _total.
COUNTERS = ("prompt_tokens", "cached_tokens")
SAMPLES = {
    f"{name}_total" if figure in COUNTERS else name: figure
    for figure, names in NAMES.items()
    for name in names
    if name
}
LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class ServerMetrics:
    engine: str  # "vllm" or "sglang": whose names the page used
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # of its KV cache, the share in use (0..1)
    block_size: int = 0  # tokens per KV block (0: not said)
    kv_blocks: int = 0  # blocks of KV it holds at most
    prompt_tokens: int = 0  # prompt tokens taken since it started
    cached_tokens: int = 0  # of them, those its prefix cache held
    started_at: float = 0.0  # its process's start, unix time (0: not said)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens it computed (taken, less its cache hits)."""
        return max(0, self.prompt_tokens - self.cached_tokens)


def parse(text: str) -> ServerMetrics:
    """The figures from a /metrics page (ValueError when it is neither engine's). A line scan,
    not a full exposition parser: the page is read every poll of every server, and only a few
    of its hundreds of samples are wanted."""
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    engine = "sglang"
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        if name == "vllm:cache_config_info":
            info = dict(LABEL.findall(head))
            continue
        figure = SAMPLES.get(name)
        if figure is None:
            continue
        engine = "vllm" if name.startswith("vllm:") else engine
        number = float(value)
        # (summed over a server's engines; its share of KV used, the largest)
        was = values.get(figure, 0.0)
        values[figure] = max(was, number) if figure == "kv_usage" else was + number
    if "running" not in values:
        raise ValueError("no running-requests figure: not a vLLM or SGLang metrics page")
    block_size = int(info.get("block_size", 0) or values.get("block_size", 0))
    blocks = int(info.get("num_gpu_blocks", 0) or 0)
    if not blocks and block_size:
        blocks = int(values.get("kv_tokens", 0)) // block_size
    return ServerMetrics(
        engine=engine,
        running=int(values["running"]),
        waiting=int(values.get("waiting", 0)),
        kv_usage=float(values.get("kv_usage", 0.0)),
        block_size=block_size,
        kv_blocks=blocks,
        prompt_tokens=int(values.get("prompt_tokens", 0)),
        cached_tokens=int(values.get("cached_tokens", 0)),
        started_at=float(values.get("started_at", 0.0)),
    )
