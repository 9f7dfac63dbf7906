"""The server's Prometheus metrics, under vLLM 0.26's names.

One :class:`PrometheusStatLogger` per server, on its own ``CollectorRegistry`` (two servers in one process,
as in the tests, never share counters). Scheduler gauges are set after every engine step; counters and
histograms grow as requests run and finish. Names, help texts and buckets are vLLM's
(``vllm/v1/metrics/loggers.py``: ``PrometheusStatLogger``); ``prometheus_client`` appends ``_total`` to a
counter's name on export, so ``vllm:num_preemptions`` is scraped as ``vllm:num_preemptions_total``, as from
vLLM. Labels: ``model_name`` and ``engine`` (always ``"0"``: one engine).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")

__all__ = ["CONTENT_TYPE_LATEST", "PrometheusStatLogger"]

disable_created_metrics()  # no *_created series: vLLM scrapes show none either


class PrometheusStatLogger:
    """The metrics the lab's server exports. Mirrors ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = (model_name, "0")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(*values)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(*values)

        self.gauge_scheduler_running = gauge("vllm:num_requests_running",
                                             "Number of requests in model execution batches.")
        self.gauge_scheduler_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.gauge_kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.counter_prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.counter_prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.counter_num_preempted_reqs = counter("vllm:num_preemptions",
                                                  "Cumulative number of preemption from the engine.")
        self.counter_prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.counter_generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=self.registry)
        self.counter_request_success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        self.histogram_time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.histogram_inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.histogram_request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.histogram_e2e_time_request = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)

    def record_scheduler(self, num_running: int, num_waiting: int, kv_cache_usage: float, new_preemptions: int,
                         prefix_queries: int, prefix_hits: int) -> None:
        """After an engine step: the scheduler's state, and what its counters gained in that step."""
        self.gauge_scheduler_running.set(num_running)
        self.gauge_scheduler_waiting.set(num_waiting)
        self.gauge_kv_cache_usage.set(kv_cache_usage)
        if new_preemptions:
            self.counter_num_preempted_reqs.inc(new_preemptions)
        if prefix_queries:
            self.counter_prefix_cache_queries.inc(prefix_queries)
        if prefix_hits:
            self.counter_prefix_cache_hits.inc(prefix_hits)

    def record_finished(self, finish_reason: str, num_prompt_tokens: int, token_times: list[float],
                        arrival_time: float, finish_time: float) -> None:
        """A request (one completion) ended: its TTFT, inter-token latencies, TPOT and end-to-end latency."""
        self.counter_request_success[finish_reason if finish_reason in FINISH_REASONS else "abort"].inc()
        self.counter_prompt_tokens.inc(num_prompt_tokens)
        self.counter_generation_tokens.inc(len(token_times))
        if token_times:
            self.histogram_time_to_first_token.observe(token_times[0] - arrival_time)
            for a, b in zip(token_times, token_times[1:], strict=False):
                self.histogram_inter_token_latency.observe(b - a)
            if len(token_times) > 1:
                self.histogram_request_time_per_output_token.observe(
                    (token_times[-1] - token_times[0]) / (len(token_times) - 1))
        self.histogram_e2e_time_request.observe(finish_time - arrival_time)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
