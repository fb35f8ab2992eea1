"""A server's load and cache as its /metrics page says them (services/router/upstream/
metrics.py), in vLLM's names and SGLang's; SGLang's names checked against its pinned release's
own metrics (vLLM's page is read for real by tests/test_upstream.py)."""

from __future__ import annotations

import pytest

from services.router.upstream.metrics import NAMES, parse
from tests.sglang_release import ROOT, load

# (lines as vLLM 0.32 writes them, two engines of one server)
VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
process_start_time_seconds 1.7964278968e+09
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.79e+09
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 640.0
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="728"} 1.0
"""


def test_vllms_page_says_its_load_and_its_cache() -> None:
    m = parse(VLLM)
    assert m.engine == "vllm"
    assert (m.running, m.waiting) == (4, 2)  # (summed over its engines; by-reason not counted)
    assert m.kv_usage == 0.5  # (the fullest engine's)
    assert (m.block_size, m.kv_blocks) == (32, 728)
    assert (m.prompt_tokens, m.cached_tokens, m.computed_tokens) == (1000, 640, 360)
    assert m.started_at == pytest.approx(1.7964278968e9)


def test_sglangs_names_are_its_pinned_releases_and_read_alike() -> None:
    load()
    source = "\n".join(p.read_text() for p in (ROOT / "sglang" / "srt").rglob("*.py"))
    names = [n for figure in NAMES.values() for n in figure if n.startswith("sglang:")]
    missing = [
        n for n in names if f'name="{n}"' not in source and f'name="{n}_total"' not in source
    ]
    assert not missing, f"not among SGLang {ROOT.name}'s metrics: {missing}"
    page = "\n".join(
        [
            'sglang:num_running_reqs{model_name="m"} 2.0',
            'sglang:num_queue_reqs{model_name="m"} 5.0',
            'sglang:token_usage{model_name="m"} 0.4',
            'sglang:page_size{model_name="m"} 64.0',
            'sglang:max_total_num_tokens{model_name="m"} 6400.0',
            'sglang:prompt_tokens_total{model_name="m"} 500.0',
            'sglang:cached_tokens_total{model_name="m"} 128.0',
        ]
    )
    m = parse(page)
    assert (m.engine, m.running, m.waiting, m.kv_usage) == ("sglang", 2, 5, 0.4)
    assert (m.block_size, m.kv_blocks, m.computed_tokens) == (64, 100, 372)


def test_a_page_of_neither_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="not a vLLM or SGLang"):
        parse("http_requests_total 5.0\n")
