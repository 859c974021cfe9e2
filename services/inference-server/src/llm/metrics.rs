//! The `generate` endpoint's metrics (catalogued in `configs/metrics.yaml`).

use prometheus::{Histogram, HistogramOpts, IntCounter, IntGauge};

/// Metrics of the LLM side; cheap to clone (shared handles).
#[derive(Clone)]
pub(crate) struct LlmMetrics {
    pub sequences_per_step: Histogram,
    pub generated_tokens: IntCounter,
    pub tokens_per_second: prometheus::Gauge,
    pub time_to_first_token: Histogram,
    pub request_seconds: Histogram,
    pub queue_depth: IntGauge,
    pub kv_cache_bytes: IntGauge,
    pub queue_full: IntCounter,
    pub prompt_tokens: IntCounter,
    pub prompt_tokens_cached: IntCounter,
    pub requests: IntCounter,
    pub adapters_loaded: IntGauge,
    pub adapter_loads: IntCounter,
    pub adapter_evictions: IntCounter,
    pub adapter_load_seconds: Histogram,
}

fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)).expect("valid histogram")
}

impl LlmMetrics {
    pub(crate) fn register(registry: &prometheus::Registry) -> Self {
        let seconds = vec![
            0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 60.0, 120.0, 300.0,
        ];
        let m = Self {
            sequences_per_step: histogram(
                "relay_llm_sequences_per_step",
                "Sequences advanced together by one decode step (the continuous batch).",
                vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
            ),
            generated_tokens: IntCounter::new(
                "relay_llm_generated_tokens_total",
                "Completion tokens generated.",
            )
            .expect("valid counter"),
            tokens_per_second: prometheus::Gauge::new(
                "relay_llm_tokens_per_second",
                "Completion tokens generated per second over the last second of decoding.",
            )
            .expect("valid gauge"),
            time_to_first_token: histogram(
                "relay_llm_time_to_first_token_seconds",
                "From a generate request's arrival to its first completion token.",
                seconds.clone(),
            ),
            request_seconds: histogram(
                "relay_llm_request_seconds",
                "From a generate request's arrival to its completion.",
                seconds,
            ),
            queue_depth: IntGauge::new(
                "relay_llm_queue_depth",
                "Generate requests waiting for a place in the continuous batch.",
            )
            .expect("valid gauge"),
            kv_cache_bytes: IntGauge::new(
                "relay_llm_kv_cache_bytes",
                "Bytes of keys and values held in the candle backend's paged KV pool (running sequences and cached prefixes).",
            )
            .expect("valid gauge"),
            queue_full: IntCounter::new(
                "relay_llm_queue_full_total",
                "Generate requests refused at once because llm.max_queue requests were already waiting.",
            )
            .expect("valid counter"),
            prompt_tokens: IntCounter::new(
                "relay_llm_prompt_tokens_total",
                "Prompt tokens of admitted generate requests.",
            )
            .expect("valid counter"),
            prompt_tokens_cached: IntCounter::new(
                "relay_llm_prompt_tokens_cached_total",
                "Prompt tokens whose keys and values came from the prefix cache instead of a prefill.",
            )
            .expect("valid counter"),
            requests: IntCounter::new(
                "relay_llm_requests_total",
                "Generate requests answered with a completion.",
            )
            .expect("valid counter"),
            adapters_loaded: IntGauge::new(
                "relay_llm_adapters_loaded",
                "LoRA adapter versions held in memory (the LRU).",
            )
            .expect("valid gauge"),
            adapter_loads: IntCounter::new(
                "relay_llm_adapter_loads_total",
                "LoRA adapter versions loaded (first loads and reloads after eviction).",
            )
            .expect("valid counter"),
            adapter_evictions: IntCounter::new(
                "relay_llm_adapter_evictions_total",
                "LoRA adapter versions dropped from memory by the LRU bound.",
            )
            .expect("valid counter"),
            adapter_load_seconds: histogram(
                "relay_llm_adapter_load_seconds",
                "Time to load one LoRA adapter version (fetch, parse, place on the model's device).",
                vec![0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0],
            ),
        };
        relay_kit::metrics::register(registry, &m.sequences_per_step);
        relay_kit::metrics::register(registry, &m.adapter_load_seconds);
        relay_kit::metrics::register(registry, &m.generated_tokens);
        relay_kit::metrics::register(registry, &m.tokens_per_second);
        relay_kit::metrics::register(registry, &m.time_to_first_token);
        relay_kit::metrics::register(registry, &m.request_seconds);
        relay_kit::metrics::register(registry, &m.queue_depth);
        relay_kit::metrics::register(registry, &m.kv_cache_bytes);
        relay_kit::metrics::register(registry, &m.queue_full);
        relay_kit::metrics::register(registry, &m.prompt_tokens);
        relay_kit::metrics::register(registry, &m.prompt_tokens_cached);
        relay_kit::metrics::register(registry, &m.requests);
        relay_kit::metrics::register(registry, &m.adapters_loaded);
        relay_kit::metrics::register(registry, &m.adapter_loads);
        relay_kit::metrics::register(registry, &m.adapter_evictions);
        m
    }
}
