//! Pure `/metrics` renderer: engine gauges + request histograms -> Prometheus text exposition.
//!
//! Four styles, matching what real servers print (text format 0.0.4, as Python's
//! `prometheus_client` writes it: counters as `NAME_total` with a `NAME_created` gauge after them,
//! floats like `1.0`, labels in declaration order):
//! - [`MetricsStyle::Vllm`]: vLLM v1 (0.10+) names and labels `model_name`, `engine`;
//!   `vllm:kv_cache_usage_perc`, `vllm:inter_token_latency_seconds`, `vllm:cache_config_info`,
//!   `vllm:lora_requests_info` when adapters are loaded.
//! - [`MetricsStyle::VllmLegacy`]: vLLM v0 / before 0.11: `vllm:gpu_cache_usage_perc`,
//!   `vllm:num_requests_swapped`, `vllm:time_per_output_token_seconds`, label `model_name` only.
//! - [`MetricsStyle::Sglang`]: SGLang's `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
//!   `sglang:token_usage`, ... with labels `model_name`, `engine_type`, `tp_rank`, `pp_rank`. Its
//!   histogram buckets are approximated by vLLM's.
//! - [`MetricsStyle::Llamacpp`]: llama.cpp `llama-server --metrics`: unlabelled gauges and counters
//!   only (no `_created`, no histograms), `llamacpp:requests_processing` (busy slots),
//!   `llamacpp:requests_deferred` (the queue), and the prompt and generation counters, which
//!   llama-server adds to when a prompt is done (tokens and seconds of prompt processing) and when a
//!   request ends (tokens and seconds of generation), as [`LlamaCounters`] keeps them.
//!
//! Buckets are vLLM's (`vllm/v1/metrics/loggers.py`).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::engine::{EngineStats, FinishReason};

/// `vllm:time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
];
/// `vllm:inter_token_latency_seconds` (and v0 `time_per_output_token_seconds`) buckets.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
/// `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds` and
/// `vllm:request_inference_time_seconds` buckets.
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
];

/// Which server's metric names to print.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum MetricsStyle {
    /// vLLM v1 (current).
    #[default]
    Vllm,
    /// vLLM before 0.11 (`vllm:gpu_cache_usage_perc`, v0 labels).
    VllmLegacy,
    /// SGLang.
    Sglang,
    /// llama.cpp `llama-server` (also serves `GET /props` with its slot count).
    Llamacpp,
}

/// llama-server's prompt and generation counters, in llama-server's units: tokens, and seconds
/// of each slot's own wall time (a prompt's processing; a request's generation after its first
/// token).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LlamaCounters {
    pub prompt_tokens: u64,
    /// Prompt tokens taken from the slot's cache instead of computed.
    pub prompt_tokens_cached: u64,
    pub prompt_s: f64,
    pub predicted_tokens: u64,
    pub predicted_s: f64,
}

/// A Prometheus histogram with fixed upper bounds.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last slot is +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    /// Record one value (non-finite values are ignored: they would poison the sum).
    pub fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// (upper bound, cumulative count) pairs, ending with (+Inf, count).
    pub fn cumulative(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        let mut acc = 0;
        self.bounds.iter().copied().chain(std::iter::once(f64::INFINITY)).zip(self.counts.iter()).map(
            move |(b, c)| {
                acc += c;
                (b, acc)
            },
        )
    }
}

/// Per-request measurements a server accumulates (times in seconds).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestMetrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue: Histogram,
    /// Time in the running batch, from first scheduled to the last token (queue excluded).
    pub inference: Histogram,
    /// Finished requests by reason: length, stop, abort.
    pub success: [u64; 3],
    pub llama: LlamaCounters,
}

impl Default for RequestMetrics {
    fn default() -> Self {
        RequestMetrics {
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
            queue: Histogram::new(REQUEST_LATENCY_BUCKETS),
            inference: Histogram::new(REQUEST_LATENCY_BUCKETS),
            success: [0; 3],
            llama: LlamaCounters::default(),
        }
    }
}

impl RequestMetrics {
    pub fn finished(&mut self, reason: FinishReason) {
        self.success[reason_index(reason)] += 1;
    }

    pub fn finished_count(&self, reason: FinishReason) -> u64 {
        self.success[reason_index(reason)]
    }
}

fn reason_index(r: FinishReason) -> usize {
    match r {
        FinishReason::Length => 0,
        FinishReason::Stop => 1,
        FinishReason::Abort => 2,
    }
}

/// LoRA adapters state for `vllm:lora_requests_info`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraInfo {
    pub max_lora: u32,
    pub running: Vec<String>,
    pub waiting: Vec<String>,
}

/// Everything one replica's `/metrics` shows.
#[derive(Debug, Clone, Copy)]
pub struct MetricsView<'a> {
    pub model_name: &'a str,
    /// Data-parallel rank label (`engine`), "0" for a single engine.
    pub engine: &'a str,
    pub stats: &'a EngineStats,
    pub requests: &'a RequestMetrics,
    pub block_size: u32,
    pub lora: Option<&'a LoraInfo>,
    /// Unix time the server started: the value of every `_created` sample.
    pub created_unix: f64,
    /// Unix time now: the value of `vllm:lora_requests_info` (vLLM sets it to the update time).
    pub now_unix: f64,
}

/// Render the exposition text in `style`.
pub fn render(style: MetricsStyle, v: &MetricsView<'_>) -> String {
    let mut w = Writer { out: String::with_capacity(16 * 1024), created: v.created_unix };
    match style {
        MetricsStyle::Vllm => render_vllm(&mut w, v, false),
        MetricsStyle::VllmLegacy => render_vllm(&mut w, v, true),
        MetricsStyle::Sglang => render_sglang(&mut w, v),
        MetricsStyle::Llamacpp => render_llamacpp(&mut w, v),
    }
    w.out
}

fn render_vllm(w: &mut Writer, v: &MetricsView<'_>, legacy: bool) {
    let model = esc(v.model_name);
    let engine = esc(v.engine);
    let base = if legacy {
        format!("model_name=\"{model}\"")
    } else {
        format!("model_name=\"{model}\",engine=\"{engine}\"")
    };
    let s = v.stats;
    w.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        &base,
        s.running.into(),
    );
    w.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        &base,
        s.waiting.into(),
    );
    if legacy {
        w.gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", &base, 0.0);
        w.gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.",
            &base,
            s.kv_usage,
        );
        w.gauge("vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.", &base, 0.0);
    } else {
        w.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", &base, s.kv_usage);
    }
    w.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        &base,
        s.num_preemptions as f64,
    );
    w.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        &base,
        s.prompt_tokens_total as f64,
    );
    w.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        &base,
        s.generation_tokens_total as f64,
    );
    if legacy {
        w.gauge("vllm:gpu_prefix_cache_hit_rate", "GPU prefix cache block hit rate.", &base, hit_rate(s));
    } else {
        w.counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            &base,
            s.prefix_cache_queries as f64,
        );
        w.counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            &base,
            s.prefix_cache_hits as f64,
        );
    }
    let reasons = [FinishReason::Stop, FinishReason::Length, FinishReason::Abort];
    let rows: Vec<(String, f64)> = reasons
        .iter()
        .map(|r| (format!("{base},finished_reason=\"{}\"", r.as_str()), v.requests.finished_count(*r) as f64))
        .collect();
    w.counter_rows("vllm:request_success", "Count of successfully processed requests.", &rows);

    let r = v.requests;
    w.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &base,
        &r.ttft,
    );
    if legacy {
        w.histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            &base,
            &r.itl,
        );
    } else {
        w.histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &base,
            &r.itl,
        );
    }
    w.histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &base,
        &r.e2e,
    );
    w.histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &base,
        &r.queue,
    );
    w.histogram(
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        &base,
        &r.inference,
    );

    if let Some(l) = v.lora {
        w.head("vllm:lora_requests_info", "Running stats on lora requests.", "gauge");
        let _ = writeln!(
            w.out,
            "vllm:lora_requests_info{{max_lora=\"{}\",waiting_lora_adapters=\"{}\",running_lora_adapters=\"{}\"}} {}",
            l.max_lora,
            esc(&l.waiting.join(",")),
            esc(&l.running.join(",")),
            num(v.now_unix)
        );
    }

    w.head("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge");
    let engine_label = if legacy { String::new() } else { format!(",engine=\"{engine}\"") };
    let _ = writeln!(
        w.out,
        "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"False\",\
         gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\"{engine_label}}} 1.0",
        v.block_size, s.num_gpu_blocks
    );
}

fn render_sglang(w: &mut Writer, v: &MetricsView<'_>) {
    let base =
        format!("model_name=\"{}\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\"", esc(v.model_name));
    let s = v.stats;
    let block = f64::from(v.block_size);
    w.gauge("sglang:num_running_reqs", "The number of running requests.", &base, s.running.into());
    w.gauge("sglang:num_used_tokens", "The number of used tokens.", &base, f64::from(s.used_blocks) * block);
    w.gauge("sglang:token_usage", "The token usage.", &base, s.kv_usage);
    w.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", &base, s.waiting.into());
    w.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", &base, hit_rate(s));
    w.gauge(
        "sglang:max_total_num_tokens",
        "Maximum total number of tokens in the KV cache pool.",
        &base,
        f64::from(s.num_gpu_blocks) * block,
    );
    w.counter(
        "sglang:prompt_tokens",
        "Number of prefill tokens processed.",
        &base,
        s.prompt_tokens_total as f64,
    );
    w.counter(
        "sglang:generation_tokens",
        "Number of generation tokens processed.",
        &base,
        s.generation_tokens_total as f64,
    );
    let r = v.requests;
    let done: u64 = r.success.iter().sum();
    w.counter("sglang:num_requests", "The number of processed requests.", &base, done as f64);
    w.histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &base,
        &r.ttft,
    );
    w.histogram(
        "sglang:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &base,
        &r.itl,
    );
    w.histogram(
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        &base,
        &r.e2e,
    );
}

fn render_llamacpp(w: &mut Writer, v: &MetricsView<'_>) {
    let (s, l) = (v.stats, &v.requests.llama);
    // The engine counts reuse when a request is admitted, the prompt counter when its first token
    // is out; the processed share is the difference, never below zero in between.
    let cached = l.prompt_tokens_cached.max(s.prefix_cache_hits);
    let rows: [(&str, &str, &str, f64); 9] = [
        (
            "prompt_tokens_total",
            "counter",
            "Number of prompt tokens processed, excluding cached tokens",
            l.prompt_tokens.saturating_sub(cached) as f64,
        ),
        (
            "prompt_tokens_cached_total",
            "counter",
            "Number of prompt tokens reused from the cache",
            cached as f64,
        ),
        ("prompt_seconds_total", "counter", "Total time spent processing prompts", l.prompt_s),
        (
            "tokens_predicted_total",
            "counter",
            "Number of generation tokens processed",
            l.predicted_tokens as f64,
        ),
        ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens", l.predicted_s),
        ("n_decode_total", "counter", "Total number of llama_decode() calls", s.steps as f64),
        ("requests_processing", "gauge", "Number of requests processing", s.running.into()),
        ("requests_deferred", "gauge", "Number of requests deferred", s.waiting.into()),
        (
            "n_busy_slots_per_decode",
            "gauge",
            "Average number of busy slots per llama_decode() call",
            busy_per_decode(s),
        ),
    ];
    for (name, kind, help, value) in rows {
        w.head(&format!("llamacpp:{name}"), help, kind);
        let _ = writeln!(w.out, "llamacpp:{name} {}", plain(value));
    }
}

/// Cached prompt tokens / prompt tokens looked up, 0 before any lookup.
fn hit_rate(s: &EngineStats) -> f64 {
    if s.prefix_cache_queries == 0 {
        0.0
    } else {
        s.prefix_cache_hits as f64 / s.prefix_cache_queries as f64
    }
}

/// Mean batch size over the steps so far (llama-server's `n_busy_slots_per_decode`).
fn busy_per_decode(s: &EngineStats) -> f64 {
    if s.steps == 0 {
        0.0
    } else {
        s.busy_seq_steps as f64 / s.steps as f64
    }
}

/// A number as llama-server prints it (C++ stream output): `56`, `0.051844`.
fn plain(v: f64) -> String {
    if v.is_finite() && v == v.trunc() && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

struct Writer {
    out: String,
    created: f64,
}

impl Writer {
    fn head(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn gauge(&mut self, name: &str, help: &str, labels: &str, value: f64) {
        self.head(name, help, "gauge");
        let _ = writeln!(self.out, "{name}{{{labels}}} {}", num(value));
    }

    fn counter(&mut self, name: &str, help: &str, labels: &str, value: f64) {
        self.counter_rows(name, help, &[(labels.to_string(), value)]);
    }

    /// A counter family: `NAME_total` samples, then the `NAME_created` gauge twin.
    fn counter_rows(&mut self, name: &str, help: &str, rows: &[(String, f64)]) {
        self.head(&format!("{name}_total"), help, "counter");
        for (labels, value) in rows {
            let _ = writeln!(self.out, "{name}_total{{{labels}}} {}", num(*value));
        }
        self.created_rows(name, help, rows.iter().map(|(l, _)| l.as_str()));
    }

    fn created_rows<'a>(&mut self, name: &str, help: &str, labels: impl Iterator<Item = &'a str>) {
        self.head(&format!("{name}_created"), help, "gauge");
        for l in labels {
            let _ = writeln!(self.out, "{name}_created{{{l}}} {}", num(self.created));
        }
    }

    fn histogram(&mut self, name: &str, help: &str, labels: &str, h: &Histogram) {
        self.head(name, help, "histogram");
        for (bound, acc) in h.cumulative() {
            let le = if bound.is_infinite() { "+Inf".to_string() } else { num(bound) };
            let _ = writeln!(self.out, "{name}_bucket{{{labels},le=\"{le}\"}} {}", num(acc as f64));
        }
        let _ = writeln!(self.out, "{name}_count{{{labels}}} {}", num(h.count() as f64));
        let _ = writeln!(self.out, "{name}_sum{{{labels}}} {}", num(h.sum()));
        self.created_rows(name, help, std::iter::once(labels));
    }
}

/// A float as Python's `repr` prints it for the values we emit: `3.0`, `0.25`, `1700000000.5`.
fn num(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v == v.trunc() && v.abs() < 1e16 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// Escape a label value (backslash, double quote, newline).
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(
        stats: &'a EngineStats,
        req: &'a RequestMetrics,
        lora: Option<&'a LoraInfo>,
    ) -> MetricsView<'a> {
        MetricsView {
            model_name: "m\"x",
            engine: "0",
            stats,
            requests: req,
            block_size: 16,
            lora,
            created_unix: 1_700_000_000.0,
            now_unix: 1_700_000_100.5,
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_upper_inclusive() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.1, 0.5, 2.0, f64::NAN] {
            h.observe(v);
        }
        let c: Vec<_> = h.cumulative().collect();
        assert_eq!(c, vec![(0.1, 1), (1.0, 2), (f64::INFINITY, 3)]);
        assert_eq!(h.count(), 3);
        assert!((h.sum() - 2.6).abs() < 1e-12);
    }

    #[test]
    fn vllm_v1_text_has_the_names_and_labels() {
        let stats =
            EngineStats { running: 3, waiting: 2, kv_usage: 0.25, num_gpu_blocks: 100, ..Default::default() };
        let mut req = RequestMetrics::default();
        req.ttft.observe(0.03);
        req.finished(FinishReason::Length);
        let lora = LoraInfo { max_lora: 2, running: vec!["a".into()], waiting: vec![] };
        let text = render(MetricsStyle::Vllm, &view(&stats, &req, Some(&lora)));
        let base = r#"model_name="m\"x",engine="0""#;
        for line in [
            format!("vllm:num_requests_running{{{base}}} 3.0"),
            format!("vllm:num_requests_waiting{{{base}}} 2.0"),
            format!("vllm:kv_cache_usage_perc{{{base}}} 0.25"),
            format!("vllm:request_success_total{{{base},finished_reason=\"length\"}} 1.0"),
            format!("vllm:time_to_first_token_seconds_bucket{{{base},le=\"0.04\"}} 1.0"),
            format!("vllm:time_to_first_token_seconds_bucket{{{base},le=\"0.02\"}} 0.0"),
            format!("vllm:time_to_first_token_seconds_bucket{{{base},le=\"+Inf\"}} 1.0"),
            format!("vllm:num_preemptions_created{{{base}}} 1700000000.0"),
            "# TYPE vllm:prompt_tokens_total counter".to_string(),
            "# TYPE vllm:inter_token_latency_seconds histogram".to_string(),
            r#"vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="",running_lora_adapters="a"} 1700000100.5"#
                .to_string(),
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
        assert!(text.contains("num_gpu_blocks=\"100\""));
        assert!(!text.contains("gpu_cache_usage_perc"));
    }

    #[test]
    fn legacy_and_sglang_use_their_names() {
        let stats = EngineStats { kv_usage: 0.5, num_gpu_blocks: 10, used_blocks: 5, ..Default::default() };
        let req = RequestMetrics::default();
        let legacy = render(MetricsStyle::VllmLegacy, &view(&stats, &req, None));
        assert!(legacy.contains("vllm:gpu_cache_usage_perc{model_name=\"m\\\"x\"} 0.5\n"), "{legacy}");
        assert!(legacy.contains("vllm:time_per_output_token_seconds_bucket"));
        assert!(!legacy.contains("engine=") && !legacy.contains("lora_requests_info"));
        let sg = render(MetricsStyle::Sglang, &view(&stats, &req, None));
        assert!(sg.contains("sglang:token_usage{"), "{sg}");
        assert!(sg.contains("sglang:num_used_tokens{") && sg.contains("} 80.0\n"));
        assert!(!sg.contains("vllm:"));
    }

    #[test]
    fn llamacpp_style_has_its_unlabelled_gauges_and_counters() {
        let stats =
            EngineStats { running: 4, waiting: 2, steps: 10, busy_seq_steps: 25, ..Default::default() };
        let req = RequestMetrics {
            llama: LlamaCounters {
                prompt_tokens: 56,
                prompt_s: 0.051844,
                predicted_tokens: 128,
                ..Default::default()
            },
            ..Default::default()
        };
        let text = render(MetricsStyle::Llamacpp, &view(&stats, &req, None));
        for line in [
            "llamacpp:requests_processing 4",
            "llamacpp:requests_deferred 2",
            "llamacpp:prompt_tokens_total 56",
            "llamacpp:prompt_seconds_total 0.051844",
            "llamacpp:tokens_predicted_total 128",
            "llamacpp:n_busy_slots_per_decode 2.5",
            "# TYPE llamacpp:tokens_predicted_seconds_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
        assert!(!text.contains("vllm:") && !text.contains("_created") && !text.contains('{'));
    }

    #[test]
    fn numbers_print_like_python() {
        assert_eq!(num(3.0), "3.0");
        assert_eq!(num(0.25), "0.25");
        assert_eq!(num(f64::INFINITY), "+Inf");
    }
}
