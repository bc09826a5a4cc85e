"""The /metrics bodies of bench_scrape.py: a realistic vLLM one and llama.cpp's (the simulator's)."""

from __future__ import annotations


_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LAT = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 32768)
_ITER = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_HANDLERS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/load", "/ping")


def _fmt(v: float) -> str:
    return repr(float(v)) if v == v else "NaN"


def vllm_body(seq: int = 0, *, dp: int = 1, running: int = 0, waiting: int = 0) -> bytes:
    """A realistic vLLM /metrics body (prometheus_client 0.0.4 text, as vLLM serves it): ``seq``
    is how many times /metrics was read before (it moves http_requests_total and a few process
    gauges, as on a real engine); ``dp`` engines each with their own per-engine series."""
    out: list[str] = []

    def fam(name: str, kind: str, doc: str, samples: list[tuple[str, str, float]]) -> None:
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            out.append(f"{name}{suffix}{{{labels}}} {_fmt(value)}" if labels else f"{name}{suffix} {_fmt(value)}")

    def hist(name: str, doc: str, buckets: tuple[float, ...], labels: str) -> list[tuple[str, str, float]]:
        s = [("_bucket", f'{labels},le="{_fmt(b)}"', 0.0) for b in buckets]
        s += [("_bucket", f'{labels},le="+Inf"', 0.0), ("_count", labels, 0.0), ("_sum", labels, 0.0)]
        return s

    gen = (("0", 41.0 + seq % 7), ("1", 12.0), ("2", 3.0))
    fam("python_gc_objects_collected", "counter", "Objects collected during gc",
        [("_total", f'generation="{g}"', v) for g, v in gen])
    fam("python_gc_objects_uncollectable", "counter", "Uncollectable objects found during GC",
        [("_total", f'generation="{g}"', 0.0) for g, _ in gen])
    fam("python_gc_collections", "counter", "Number of times this generation was collected",
        [("_total", f'generation="{g}"', v + seq // 3) for g, v in gen])
    fam("python_info", "gauge", "Python platform information",
        [("", 'implementation="CPython",major="3",minor="12",patchlevel="11",version="3.12.11"', 1.0)])
    for name, doc, v in (("process_virtual_memory_bytes", "Virtual memory size in bytes.", 3.1e10),
                         ("process_resident_memory_bytes", "Resident memory size in bytes.", 2.2e9 + 4096 * (seq % 5)),
                         ("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                          1.76e9),
                         ("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                          1234.5 + 0.01 * seq),
                         ("process_open_fds", "Number of open file descriptors.", 87.0),
                         ("process_max_fds", "Maximum number of open file descriptors.", 1048576.0)):
        fam(name, "counter" if name.endswith("_total") else "gauge", doc, [("", "", v)])
    eng = [f'engine="{e}",model_name="meta-llama/Llama-3.1-8B-Instruct"' for e in range(dp)]
    fam("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
        [("", lb, float(running)) for lb in eng])
    fam("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
        [("", lb, float(waiting)) for lb in eng])
    fam("vllm:engine_sleep_state", "gauge", "Engine sleep state; awake = 0 means engine is sleeping",
        [("", f'{lb},sleep_state="{s}"', 1.0 if s == "awake" else 0.0) for lb in eng
         for s in ("awake", "weights_offloaded", "discard_all")])
    fam("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
        [("", lb, 0.0) for lb in eng])
    for name, doc in (("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
                      ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
                      ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
                      ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
                      ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
                      ("vllm:prompt_tokens", "Number of prefill tokens processed."),
                      ("vllm:generation_tokens", "Number of generation tokens processed.")):
        fam(name, "counter", doc, [(sfx, lb, 0.0) for lb in eng for sfx in ("_total", "_created")])
    fam("vllm:request_success", "counter", "Count of successfully processed requests.",
        [(sfx, f'{lb},finished_reason="{r}"', 0.0) for lb in eng for r in ("stop", "length", "abort", "error")
         for sfx in ("_total", "_created")])
    for name, doc, buckets in (
            ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", _ITER),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKENS),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.", _TOKENS),
            ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
             _TOKENS),
            ("vllm:request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20)),
            ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", _TOKENS),
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL),
            ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
             _ITL),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _LAT),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _LAT),
            ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", _LAT),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _LAT),
            ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _LAT)):
        fam(name, "histogram", doc, [s for lb in eng for s in hist(name, doc, buckets, lb)])
    fam("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
        [("", f'block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",'
              f'engine="{e}",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",'
              f'num_gpu_blocks="27910",prefix_caching_hash_algo="sha256",swap_space="4"', 1.0) for e in range(dp)])
    fam("http_requests", "counter", "Total number of requests by method, status and handler.",
        [("_total", f'handler="{h}",method="{"GET" if h in ("/v1/models", "/health", "/metrics") else "POST"}",'
                    f'status="2xx"', float(seq if h == "/metrics" else 10)) for h in _HANDLERS])
    for name, doc in (("http_request_size_bytes", "Content length of incoming requests by handler."),
                      ("http_response_size_bytes", "Content length of outgoing responses by handler.")):
        fam(name, "summary", doc, [(sfx, f'handler="{h}"', float(seq if h == "/metrics" else 10))
                                   for h in _HANDLERS for sfx in ("_count", "_sum", "_created")])
    fam("http_request_duration_highr_seconds", "histogram", "Latency with many buckets but no API specific labels.",
        [(f"_bucket", f'le="{_fmt(b)}"', float(seq)) for b in
         (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0,
          60.0)] + [("_bucket", 'le="+Inf"', float(seq)), ("_count", "", float(seq)), ("_sum", "", 0.002 * seq)])
    fam("http_request_duration_seconds", "histogram", "Latency with only few buckets by handler.",
        [s for h in _HANDLERS for s in
         [("_bucket", f'handler="{h}",le="{b}",method="GET"', float(seq)) for b in ("0.1", "0.5", "1.0", "+Inf")]
         + [("_count", f'handler="{h}",method="GET"', float(seq)), ("_sum", f'handler="{h}",method="GET"', 0.001 * seq)]])
    return ("\n".join(out) + "\n").encode()


def llamacpp_body() -> bytes:
    from types import SimpleNamespace

    from llmgw.sim.llamacpp_core import Metrics
    from llmgw.sim.llamacpp_surface import metrics_text
    core = SimpleNamespace(metrics=Metrics(prompt_tokens=700, prompt_cached=300, predicted_tokens=50),
                           requests_processing=0, requests_deferred=0)
    return metrics_text(core).encode()  # type: ignore[arg-type]


