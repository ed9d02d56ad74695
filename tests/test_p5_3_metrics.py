"""Phase 5.3: /health and /metrics report the engine, and /metrics, parsed by prometheus-client's parser, holds
every vLLM-named series equal to ours, while requests run and after.
"""

from __future__ import annotations

import math
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.test_p5_isolation import assert_all_blocks_free, metrics, srv  # noqa: F401  (srv: a fixture)
from tests.test_p5_pool_view import SYSTEM, TIMEOUT_S, complete, serve
from tests.test_p5_serving import CLIENT_TIMEOUT_S, PROMPT, client

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


def scrape(srv) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus-client; a labelled one as `name{k=v,...}`."""
    text = httpx.get(srv.url + "/metrics", timeout=TIMEOUT_S, trust_env=False).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            if s.name.startswith("vllm:"):
                assert s.labels["model_name"] == srv.served
            out[s.name + (str(sorted(labels.items())) if labels else "")] = s.value
    return out


def test_health_and_metrics_report_the_engine(srv):
    c = client(srv)
    kw = dict(model="tiny", prompt=" ".join([PROMPT] * 8), max_tokens=4,   # 40 tokens: 2 full blocks of 16
              temperature=0, extra_body={"ignore_eos": True})
    c.completions.create(**kw)
    c.completions.create(**kw)            # the same prompt again: its full blocks come from the prefix cache
    h = assert_all_blocks_free(srv)
    for key in ("running", "waiting", "preempted", "free_blocks", "total_blocks", "prefix_hit_rate", "tokens_per_s",
                "preemptions", "generated_tokens", "step_failures", "queued_requests", "max_waiting"):
        assert key in h, key
    assert h["prefix_hit_rate"] > 0 and h["tokens_per_s"] > 0 and h["generated_tokens"] >= 8
    r = httpx.get(srv.url + "/metrics", timeout=CLIENT_TIMEOUT_S, trust_env=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = metrics(srv)
    assert m["engine_running_sequences"] == 0 and m["engine_waiting_sequences"] == 0
    assert m["engine_preempted_sequences"] == 0 and m["engine_kv_blocks_free"] == m["engine_kv_blocks_total"] == 128
    assert 0 < m["engine_prefix_cache_hit_rate"] <= 1 and m["engine_generation_tokens_per_second"] > 0
    assert m["engine_generation_tokens_total"] >= 8 and "engine_preemptions_total" in m


def test_metrics_parse_and_vllms_names_hold_our_values(tiny32):
    # 20 blocks for 3 requests of 2 samples, each request up to 13 blocks: the pool runs dry, so preemptions count
    srv = serve(tiny32, n_blocks=20, block_size=16, max_running=4)
    with srv:
        answers = []
        threads = [threading.Thread(target=lambda i=i: answers.append(
            complete(srv, SYSTEM + f"Q{i}?", 60, ignore_eos=True, n=2))) for i in range(3)]
        for t in threads:
            t.start()
        mid = scrape(srv)            # while they run
        for t in threads:
            t.join(TIMEOUT_S)
        assert len(answers) == 3
        end = scrape(srv)
    for m in (mid, end):
        for vllm_name, ours in VLLM_EQUALS_OURS.items():
            assert math.isclose(m[vllm_name], ours(m), abs_tol=1e-12), vllm_name
        for vllm_name, ours in HISTOGRAMS.items():
            vllm_series = {k.removeprefix(vllm_name): v for k, v in m.items() if k.startswith(vllm_name)}
            our_series = {k.removeprefix(ours): v for k, v in m.items() if k.startswith(ours)}
            assert vllm_series == our_series and len(vllm_series) > 3
    assert end["vllm:generation_tokens_total"] == 3 * 2 * 60
    assert end["vllm:num_preemptions_total"] > 0
    assert end["vllm:prefix_cache_hits_total"] > 0
    assert end["vllm:time_to_first_token_seconds_count"] == 3
    assert end["vllm:inter_token_latency_seconds_count"] == 3 * 2 * 59
    assert end["vllm:num_requests_running"] == 0 and end["vllm:kv_cache_usage_perc"] == 0
