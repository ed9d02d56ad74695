"""Phase 5.3: the metered async engine, driven directly on an event loop (no HTTP): its Prometheus exposition,
parsed by prometheus-client's parser, counts what it served (tokens, TTFT and ITL observations, preemptions,
prefix hits), and every vLLM-named series equals ours, while requests run and after. (Over HTTP, /health and
/metrics are tested with phase 5.6's server.)
"""

from __future__ import annotations

import asyncio
import math

from prometheus_client.parser import text_string_to_metric_families

from phases.p5_1_served_engine.engine import ServingEngine
from phases.p5_3_metrics.metrics import MeteredAsyncEngine, exposition, metrics_registry
from phases.p5_3_metrics.vllm_metrics import VllmCollector

VLLM_EQUALS_OURS = {   # vLLM's series -> ours, as a function of our samples
    "vllm:num_requests_running": lambda o: o["engine_running_sequences"],
    "vllm:num_requests_waiting": lambda o: o["engine_waiting_sequences"] + o["engine_preempted_sequences"],
    "vllm:kv_cache_usage_perc": lambda o: 1 - o["engine_kv_blocks_free"] / o["engine_kv_blocks_total"],
    "vllm:prefix_cache_queries_total": lambda o: o["engine_prefix_cache_queried_tokens_total"],
    "vllm:prefix_cache_hits_total": lambda o: o["engine_prefix_cache_hit_tokens_total"],
    "vllm:num_preemptions_total": lambda o: o["engine_preemptions_total"],
    "vllm:generation_tokens_total": lambda o: o["engine_generation_tokens_total"],
}
HISTOGRAMS = {"vllm:time_to_first_token_seconds": "engine_time_to_first_token_seconds",
              "vllm:inter_token_latency_seconds": "engine_inter_token_latency_seconds"}
SYSTEM = "You are a careful assistant. Answer in one short sentence, and never make anything up. " * 3
N_REQUESTS, N_SAMPLES, N_TOKENS = 3, 2, 60
TIMEOUT_S = 60


def samples_of(text: str, served: str) -> dict[str, float]:
    """Every sample of a /metrics body, parsed by prometheus-client; a labelled one as `name[(k, v), ...]`."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            if s.name.startswith("vllm:"):
                assert s.labels["model_name"] == served
            out[s.name + (str(sorted(labels.items())) if labels else "")] = s.value
    return out


def assert_vllms_names_equal_ours(m: dict[str, float]) -> None:
    for vllm_name, ours in VLLM_EQUALS_OURS.items():
        assert math.isclose(m[vllm_name], ours(m), abs_tol=1e-12), vllm_name
    for vllm_name, ours in HISTOGRAMS.items():
        vllm_series = {k.removeprefix(vllm_name): v for k, v in m.items() if k.startswith(vllm_name)}
        our_series = {k.removeprefix(ours): v for k, v in m.items() if k.startswith(ours)}
        assert vllm_series == our_series and len(vllm_series) > 3


def test_the_metered_engine_counts_what_it_served_and_vllms_names_equal_ours(tiny32):
    # 20 blocks for 3 requests of 2 samples, each request up to 13 blocks: the pool runs dry, so preemptions count
    aengine = MeteredAsyncEngine(ServingEngine(tiny32, max_running=4, block_size=16, n_blocks=20))
    registry = metrics_registry(aengine, VllmCollector(aengine, "tiny"))
    scrape = lambda: samples_of(exposition(registry)[0].decode(), "tiny")   # noqa: E731

    async def serve() -> tuple[dict, list[int]]:
        aengine.start()
        try:
            reqs = [await aengine.submit(tiny32.prompt_ids(SYSTEM + f"Q{i}?", chat=False), n=N_SAMPLES,
                                         max_tokens=N_TOKENS, ignore_eos=True) for i in range(N_REQUESTS)]

            async def count(req) -> int:
                return sum([1 async for _ in aengine.tokens(req)])
            tasks = [asyncio.ensure_future(count(r)) for r in reqs]
            while aengine.n_generated == 0:      # scrape once while they run
                await asyncio.sleep(0.01)
            mid = scrape()
            return mid, await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        finally:
            await aengine.stop()                 # its last snapshot: after every request is over

    mid, counted = asyncio.run(serve())
    end = scrape()
    assert counted == [N_SAMPLES * N_TOKENS] * N_REQUESTS
    for m in (mid, end):
        assert_vllms_names_equal_ours(m)
    assert end["engine_generation_tokens_total"] == N_REQUESTS * N_SAMPLES * N_TOKENS
    assert end["vllm:num_preemptions_total"] > 0 and end["vllm:prefix_cache_hits_total"] > 0
    assert end["vllm:time_to_first_token_seconds_count"] == N_REQUESTS          # a request's first token, any sample
    assert end["vllm:inter_token_latency_seconds_count"] == N_REQUESTS * N_SAMPLES * (N_TOKENS - 1)
    assert end["vllm:num_requests_running"] == 0 and end["vllm:kv_cache_usage_perc"] == 0
    assert aengine.stats.free_blocks == aengine.stats.total_blocks and aengine.stats.requests_failed == 0
