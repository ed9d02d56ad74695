"""vLLM's metric names on /metrics, beside ours, where the meaning is the same.

A dashboard or autoscaler built for vLLM (a KEDA rule on `vllm:num_requests_waiting`) reads these
names, labelled `model_name`, unchanged. Each comes from the same snapshot as ours, so the two agree:

    vLLM's name                          ours                                          note
    vllm:num_requests_running            engine_running_sequences                      vLLM's n samples are requests of their own
    vllm:num_requests_waiting            engine_waiting_sequences + _preempted_sequences  vLLM queues preempted ones as waiting
    vllm:kv_cache_usage_perc             1 - engine_kv_blocks_free / _kv_blocks_total   a fraction, as vLLM's (cached-free counts free)
    vllm:prefix_cache_queries_total      engine_prefix_cache_queried_tokens_total      in tokens, as vLLM's
    vllm:prefix_cache_hits_total         engine_prefix_cache_hit_tokens_total
    vllm:num_preemptions_total           engine_preemptions_total                      we count a group once
    vllm:generation_tokens_total         engine_generation_tokens_total
    vllm:time_to_first_token_seconds     engine_time_to_first_token_seconds            vLLM's buckets
    vllm:inter_token_latency_seconds     engine_inter_token_latency_seconds            vLLM's buckets
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from phases.p5_3_metrics.metrics import EngineStats

VLLM_PREFIX = "vllm"


def kv_cache_usage(s: EngineStats) -> float:
    """The fraction of the pool in use, 0 to 1; cached-free blocks count free (they are reclaimable)."""
    return 1.0 - s.free_blocks / s.total_blocks


class VllmCollector:
    """The snapshot's values under vLLM's names, labelled `model_name` as vLLM labels them."""

    def __init__(self, aengine, model_name: str):
        self.aengine = aengine
        self.labels = {"model_name": model_name}

    def _one(self, family_class, name: str, doc: str, value: float):
        family = family_class(f"{VLLM_PREFIX}:{name}", doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        s: EngineStats = self.aengine.stats
        yield self._one(GaugeMetricFamily, "num_requests_running", "Requests in model execution batches", s.running)
        yield self._one(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be processed",
                        s.waiting + s.preempted)
        yield self._one(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent",
                        kv_cache_usage(s))
        yield self._one(CounterMetricFamily, "prefix_cache_queries", "Prefix cache queries, in tokens",
                        s.prefix_tokens_queried)
        yield self._one(CounterMetricFamily, "prefix_cache_hits", "Prefix cache hits, in tokens", s.prefix_tokens_hit)
        yield self._one(CounterMetricFamily, "num_preemptions", "Cumulative number of preemptions", s.preemptions)
        yield self._one(CounterMetricFamily, "generation_tokens", "Number of generation tokens processed",
                        s.generated_tokens)
        yield self.aengine.ttft.family(f"{VLLM_PREFIX}:time_to_first_token_seconds",
                                       "Histogram of time to first token in seconds", self.labels)
        yield self.aengine.itl.family(f"{VLLM_PREFIX}:inter_token_latency_seconds",
                                      "Histogram of inter-token latency in seconds", self.labels)
