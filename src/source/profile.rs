//! Server profiles: which metric names carry each load signal for each model server, and the PromQL
//! the Prometheus source runs for them.
//!
//! Aggregation per server follows what the numbers mean: queue lengths and running requests add up
//! over vLLM's data-parallel `engine` series; KV usage is averaged (each engine has its own cache);
//! mean processing time is rate(sum)/rate(count) of the end-to-end latency histogram, and mean
//! service time the same of the time-in-the-running-batch histogram (vLLM's
//! `vllm:request_inference_time_seconds`), which carries no queueing; mean queue time likewise of
//! `vllm:request_queue_time_seconds`. vLLM's KV gauge was renamed (`vllm:gpu_cache_usage_perc`
//! is gone since late 2025): the old name is read only where the new one is missing.
//!
//! llama.cpp's `llama-server` has no histograms and no KV gauge, only gauges and counters. Its speed
//! is a ratio of counter growths ([`CounterRatio`]): seconds of prompt processing and generation
//! per generated token (each slot's wall time, so it grows with a busy batch as users feel it), and
//! its prompt-cache reuse the cached share of prompt tokens. Its slot count is not on the page: the
//! scrape source reads it from `GET /props` (`total_slots`), Prometheus pools give it in `slots`.

use std::time::Duration;

use serde::Deserialize;

/// The model servers we know the metric names of.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProfileName {
    /// vLLM v1 (0.11 and later); also reads `vllm:gpu_cache_usage_perc` where only that exists.
    #[default]
    Vllm,
    /// vLLM before 0.11 (`vllm:gpu_cache_usage_perc`).
    VllmLegacy,
    Sglang,
    Trtllm,
    Nim,
    Tgi,
    /// llama.cpp `llama-server --metrics`: slots instead of a KV gauge, counters instead of
    /// histograms.
    Llamacpp,
    /// No built-in names: everything comes from `metrics` or `queries`.
    Custom,
}

/// Metric names per signal, replacing the profile's.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricOverrides {
    pub waiting: Option<String>,
    pub running: Option<String>,
    pub kv_usage: Option<String>,
    /// Base name of a latency histogram (without `_sum`/`_count`).
    pub latency_histogram: Option<String>,
    /// Base name of a histogram of the time requests spend running, queue excluded.
    pub service_histogram: Option<String>,
    /// Base name of a histogram of the time requests wait in the queue before they first run.
    pub queue_histogram: Option<String>,
}

/// Raw PromQL per signal, replacing the generated query. Each must return one series per member,
/// aggregated `by` the join label.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueryOverrides {
    pub waiting: Option<String>,
    pub running: Option<String>,
    pub kv_usage: Option<String>,
    /// Mean processing time in seconds.
    pub latency: Option<String>,
    /// Mean service time in seconds: time running, queue excluded.
    pub service: Option<String>,
    /// Mean time in seconds requests waited in the queue before they first ran.
    pub queue_time: Option<String>,
}

impl QueryOverrides {
    pub fn is_empty(&self) -> bool {
        self.waiting.is_none()
            && self.running.is_none()
            && self.kv_usage.is_none()
            && self.latency.is_none()
            && self.service.is_none()
            && self.queue_time.is_none()
    }
}

/// Metric names for each signal after overrides. Several names mean "whichever exists", first wins.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricNames {
    pub waiting: Vec<String>,
    pub running: Vec<String>,
    pub kv_usage: Vec<String>,
    pub latency_histogram: Vec<String>,
    pub service_histogram: Vec<String>,
    pub queue_histogram: Vec<String>,
    /// Seconds of work per generated token, from counters (llama.cpp).
    pub token_time: Option<CounterRatio>,
    /// Share of prompt tokens served from the prompt cache, from counters (vLLM, llama.cpp).
    pub prompt_cached: Option<CounterRatio>,
    /// The same share as a gauge 0..1, where the server publishes only that (vLLM before 0.7,
    /// SGLang); read when there is no counter ratio.
    pub prompt_cached_gauge: Vec<String>,
    /// The server reports its slot count at `GET /props` (`total_slots`, llama.cpp).
    pub slots_from_props: bool,
}

/// A signal that is the growth of some counters over the growth of others in the same window:
/// `sum(rate(numerators)) / sum(rate(denominators))`. Every counter must be on the page.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterRatio {
    pub numerators: Vec<String>,
    pub denominators: Vec<String>,
}

impl CounterRatio {
    fn of(numerators: &[&str], denominators: &[&str]) -> Option<CounterRatio> {
        Some(CounterRatio { numerators: names(numerators), denominators: names(denominators) })
    }

    /// Every counter it reads.
    pub fn counters(&self) -> impl Iterator<Item = &String> {
        self.numerators.iter().chain(&self.denominators)
    }
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

impl ProfileName {
    pub fn metric_names(self) -> MetricNames {
        let (w, r, kv, lat): (&[&str], &[&str], &[&str], &[&str]) = match self {
            ProfileName::Vllm => (
                &["vllm:num_requests_waiting"],
                &["vllm:num_requests_running"],
                &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
                &["vllm:e2e_request_latency_seconds"],
            ),
            ProfileName::VllmLegacy => (
                &["vllm:num_requests_waiting"],
                &["vllm:num_requests_running"],
                &["vllm:gpu_cache_usage_perc"],
                &["vllm:e2e_request_latency_seconds"],
            ),
            ProfileName::Sglang => (
                &["sglang:num_queue_reqs"],
                &["sglang:num_running_reqs"],
                &["sglang:token_usage"],
                &["sglang:e2e_request_latency_seconds"],
            ),
            ProfileName::Trtllm => (
                &["trtllm_num_requests_waiting"],
                &["trtllm_num_requests_running"],
                &["trtllm_kv_cache_utilization"],
                &["trtllm_e2e_request_latency_seconds"],
            ),
            ProfileName::Nim => (
                &["num_requests_waiting"],
                &["num_requests_running"],
                &["gpu_cache_usage_perc"],
                &["e2e_request_latency_seconds"],
            ),
            ProfileName::Tgi => {
                (&["tgi_queue_size"], &["tgi_batch_current_size"], &[], &["tgi_request_duration"])
            }
            ProfileName::Llamacpp => {
                (&["llamacpp:requests_deferred"], &["llamacpp:requests_processing"], &[], &[])
            }
            ProfileName::Custom => (&[], &[], &[], &[]),
        };
        // Time in the running batch (first scheduled to last token) and time in the queue before
        // it: vLLM's (0.6 and later) only. Both are free of the other, so a server's speed reads the
        // same whether or not it has a backlog.
        let (service, queue): (&[&str], &[&str]) = match self {
            ProfileName::Vllm | ProfileName::VllmLegacy => {
                (&["vllm:request_inference_time_seconds"], &["vllm:request_queue_time_seconds"])
            }
            _ => (&[], &[]),
        };
        let llamacpp = self == ProfileName::Llamacpp;
        MetricNames {
            waiting: names(w),
            running: names(r),
            kv_usage: names(kv),
            latency_histogram: names(lat),
            service_histogram: names(service),
            queue_histogram: names(queue),
            // Prefill and generation time per generated token: a request's whole work, spread over
            // its output, so servers serving the same mix compare by it as by a service time.
            token_time: llamacpp
                .then(|| {
                    CounterRatio::of(
                        &["llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_seconds_total"],
                        &["llamacpp:tokens_predicted_total"],
                    )
                })
                .flatten(),
            // Cached prompt tokens over all prompt tokens. vLLM counts both (queries are every
            // prompt token looked up, hits the ones found); llama.cpp's `prompt_tokens_total`
            // counts only the tokens processed, so the whole is cached + processed.
            prompt_cached: match self {
                ProfileName::Vllm => {
                    CounterRatio::of(&["vllm:prefix_cache_hits_total"], &["vllm:prefix_cache_queries_total"])
                }
                ProfileName::Llamacpp => CounterRatio::of(
                    &["llamacpp:prompt_tokens_cached_total"],
                    &["llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_tokens_total"],
                ),
                _ => None,
            },
            prompt_cached_gauge: names(match self {
                ProfileName::VllmLegacy => &["vllm:gpu_prefix_cache_hit_rate"],
                ProfileName::Sglang => &["sglang:cache_hit_rate"],
                _ => &[],
            }),
            slots_from_props: llamacpp,
        }
    }

    /// The profile's names with per-signal overrides applied.
    pub fn resolve(self, o: &MetricOverrides) -> MetricNames {
        let mut n = self.metric_names();
        let set = |slot: &mut Vec<String>, v: &Option<String>| {
            if let Some(v) = v {
                *slot = vec![v.clone()];
            }
        };
        set(&mut n.waiting, &o.waiting);
        set(&mut n.running, &o.running);
        set(&mut n.kv_usage, &o.kv_usage);
        set(&mut n.latency_histogram, &o.latency_histogram);
        set(&mut n.service_histogram, &o.service_histogram);
        set(&mut n.queue_histogram, &o.queue_histogram);
        n
    }
}

/// One load signal of a member.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Signal {
    Waiting,
    Running,
    KvUsage,
    /// Mean end-to-end processing time (queueing included).
    Latency,
    /// Mean time requests spend running (queueing excluded).
    Service,
    /// Mean time requests waited in the queue before they first ran.
    QueueTime,
    /// Seconds of work per generated token (llama.cpp's counters).
    TokenTime,
    /// Share of prompt tokens served from the prompt cache, 0..=1.
    PromptCached,
    /// Requests the server runs at most at once (llama.cpp's slots): from `GET /props` or the
    /// pool's `slots`, never from a query.
    Slots,
    /// Unix time of the newest raw sample behind `Waiting`: gives the sample's age.
    Timestamp,
}

const _: () = assert!(Signal::Timestamp as usize + 1 == Signal::COUNT, "Signal::COUNT is stale");

impl Signal {
    /// How many signals there are (for arrays indexed by `signal as usize`).
    pub const COUNT: usize = 10;

    pub fn as_str(self) -> &'static str {
        match self {
            Signal::Waiting => "waiting",
            Signal::Running => "running",
            Signal::KvUsage => "kv_usage",
            Signal::Latency => "latency",
            Signal::Service => "service",
            Signal::QueueTime => "queue_time",
            Signal::TokenTime => "token_time",
            Signal::PromptCached => "prompt_cached",
            Signal::Slots => "slots",
            Signal::Timestamp => "timestamp",
        }
    }
}

/// The PromQL for each signal of a pool, given its names, overrides, join label and selector.
pub fn promql(
    names: &MetricNames,
    overrides: &QueryOverrides,
    join_label: &str,
    selector: Option<&str>,
    rate_window: Duration,
) -> Vec<(Signal, String)> {
    let sel = |metric: &str| selected(metric, selector);
    // `a or b`: the first name's series where it exists, the second's elsewhere. Lets one profile read
    // servers on both sides of a metric rename without double counting.
    let either = |agg: &str, list: &[String]| -> Option<String> {
        let parts: Vec<String> =
            list.iter().map(|m| format!("{agg} by ({join_label}) ({})", sel(m))).collect();
        (!parts.is_empty()).then(|| parts.join(" or "))
    };
    let window = humantime::format_duration(rate_window).to_string().replace(' ', "");
    let mut out = Vec::new();
    if let Some(q) = overrides.waiting.clone().or_else(|| either("sum", &names.waiting)) {
        out.push((Signal::Waiting, q));
    }
    if let Some(q) = overrides.running.clone().or_else(|| either("sum", &names.running)) {
        out.push((Signal::Running, q));
    }
    if let Some(q) = overrides.kv_usage.clone().or_else(|| either("avg", &names.kv_usage)) {
        out.push((Signal::KvUsage, q));
    }
    // Mean of a histogram over the window; `> 0` drops servers that finished nothing in it, instead
    // of dividing by zero.
    let mean_of = |histograms: &[String]| -> Option<String> {
        let parts: Vec<String> = histograms
            .iter()
            .map(|h| {
                format!(
                    "sum by ({join_label}) (rate({}[{window}])) / (sum by ({join_label}) (rate({}[{window}])) > 0)",
                    sel(&format!("{h}_sum")),
                    sel(&format!("{h}_count"))
                )
            })
            .collect();
        (!parts.is_empty()).then(|| parts.join(" or "))
    };
    if let Some(q) = overrides.latency.clone().or_else(|| mean_of(&names.latency_histogram)) {
        out.push((Signal::Latency, q));
    }
    if let Some(q) = overrides.service.clone().or_else(|| mean_of(&names.service_histogram)) {
        out.push((Signal::Service, q));
    }
    if let Some(q) = overrides.queue_time.clone().or_else(|| mean_of(&names.queue_histogram)) {
        out.push((Signal::QueueTime, q));
    }
    let rates = |counters: &[String]| -> String {
        let parts: Vec<String> =
            counters.iter().map(|c| format!("sum by ({join_label}) (rate({}[{window}]))", sel(c))).collect();
        parts.join(" + ")
    };
    for (signal, ratio) in
        [(Signal::TokenTime, &names.token_time), (Signal::PromptCached, &names.prompt_cached)]
    {
        if let Some(r) = ratio {
            // `> 0`: no value where nothing was counted in the window, instead of 0/0.
            out.push((signal, format!("({}) / (({}) > 0)", rates(&r.numerators), rates(&r.denominators))));
        }
    }
    if names.prompt_cached.is_none() {
        if let Some(q) = either("avg", &names.prompt_cached_gauge) {
            out.push((Signal::PromptCached, q));
        }
    }
    // The sample age comes from the raw series' own timestamp; an overridden query has no raw series
    // we can name, and its age is then the evaluation time (zero).
    if overrides.waiting.is_none() {
        if let Some(first) = names.waiting.first() {
            out.push((Signal::Timestamp, format!("max by ({join_label}) (timestamp({}))", sel(first))));
        }
    }
    out
}

/// `metric{selector}`, or the bare metric without a selector.
fn selected(metric: &str, selector: Option<&str>) -> String {
    match selector {
        Some(s) if !s.trim().is_empty() => format!("{metric}{{{s}}}"),
        _ => metric.to_string(),
    }
}

/// The query that tells which tier labels each member's series carry: one row per member and label
/// combination, from the waiting metrics (either name where a profile knows two, like the signal
/// queries; `up` when none is known), so Thanos external labels and target labels both show.
pub fn labels_promql(
    names: &MetricNames,
    join_label: &str,
    selector: Option<&str>,
    labels: &[String],
) -> String {
    let by = format!("group by ({join_label}, {})", labels.join(", "));
    let metrics: Vec<&str> = match names.waiting.is_empty() {
        true => vec!["up"],
        false => names.waiting.iter().map(String::as_str).collect(),
    };
    metrics.iter().map(|m| format!("{by} ({})", selected(m, selector))).collect::<Vec<_>>().join(" or ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_labels_query_keeps_the_tier_labels_on_either_waiting_name() {
        let names = MetricNames {
            waiting: vec!["vllm:num_requests_waiting".into(), "vllm_num_requests_waiting".into()],
            ..MetricNames::default()
        };
        let q = labels_promql(&names, "instance", Some(r#"job="vllm""#), &["cluster".into()]);
        assert_eq!(
            q,
            r#"group by (instance, cluster) (vllm:num_requests_waiting{job="vllm"}) or group by (instance, cluster) (vllm_num_requests_waiting{job="vllm"})"#
        );
        assert_eq!(
            labels_promql(&MetricNames::default(), "pod", None, &["zone".into()]),
            "group by (pod, zone) (up)"
        );
    }

    #[test]
    fn vllm_queries_aggregate_by_join_label_and_accept_both_kv_names() {
        let q = promql(
            &ProfileName::Vllm.metric_names(),
            &QueryOverrides::default(),
            "instance",
            Some("job=\"vllm\""),
            Duration::from_secs(60),
        );
        let get = |s: Signal| q.iter().find(|(x, _)| *x == s).map(|(_, q)| q.as_str()).expect("signal");
        assert_eq!(get(Signal::Waiting), "sum by (instance) (vllm:num_requests_waiting{job=\"vllm\"})");
        assert_eq!(
            get(Signal::KvUsage),
            "avg by (instance) (vllm:kv_cache_usage_perc{job=\"vllm\"}) or avg by (instance) (vllm:gpu_cache_usage_perc{job=\"vllm\"})"
        );
        assert!(get(Signal::Latency).contains("rate(vllm:e2e_request_latency_seconds_sum{job=\"vllm\"}[1m])"));
        assert_eq!(
            get(Signal::Service),
            "sum by (instance) (rate(vllm:request_inference_time_seconds_sum{job=\"vllm\"}[1m])) / \
             (sum by (instance) (rate(vllm:request_inference_time_seconds_count{job=\"vllm\"}[1m])) > 0)"
        );
        assert_eq!(
            get(Signal::QueueTime),
            "sum by (instance) (rate(vllm:request_queue_time_seconds_sum{job=\"vllm\"}[1m])) / \
             (sum by (instance) (rate(vllm:request_queue_time_seconds_count{job=\"vllm\"}[1m])) > 0)"
        );
        assert_eq!(
            get(Signal::Timestamp),
            "max by (instance) (timestamp(vllm:num_requests_waiting{job=\"vllm\"}))"
        );
    }

    #[test]
    fn llamacpp_reads_its_gauges_and_counter_ratios() {
        let names = ProfileName::Llamacpp.metric_names();
        assert!(names.slots_from_props && names.kv_usage.is_empty());
        let q = promql(&names, &QueryOverrides::default(), "instance", None, Duration::from_secs(60));
        let get = |s: Signal| q.iter().find(|(x, _)| *x == s).map(|(_, q)| q.as_str()).expect("signal");
        assert_eq!(get(Signal::Waiting), "sum by (instance) (llamacpp:requests_deferred)");
        assert_eq!(get(Signal::Running), "sum by (instance) (llamacpp:requests_processing)");
        assert_eq!(
            get(Signal::TokenTime),
            "(sum by (instance) (rate(llamacpp:prompt_seconds_total[1m])) + sum by (instance) \
             (rate(llamacpp:tokens_predicted_seconds_total[1m]))) / ((sum by (instance) \
             (rate(llamacpp:tokens_predicted_total[1m]))) > 0)"
        );
        assert!(get(Signal::PromptCached).starts_with(
            "(sum by (instance) (rate(llamacpp:prompt_tokens_cached_total[1m]))) / ((sum by (instance) \
             (rate(llamacpp:prompt_tokens_cached_total[1m])) + "
        ));
        assert!(q.iter().all(|(s, _)| !matches!(s, Signal::KvUsage | Signal::Latency | Signal::Service)));
    }

    #[test]
    fn tgi_has_no_kv_signal() {
        let q = promql(
            &ProfileName::Tgi.metric_names(),
            &QueryOverrides::default(),
            "pod",
            None,
            Duration::from_secs(30),
        );
        assert!(q.iter().all(|(s, _)| *s != Signal::KvUsage));
        assert!(q.iter().any(|(s, q)| *s == Signal::Waiting && q == "sum by (pod) (tgi_queue_size)"));
    }

    #[test]
    fn overrides_replace_names_and_queries() {
        let names = ProfileName::Custom.resolve(&MetricOverrides {
            waiting: Some("my_queue".into()),
            running: Some("my_running".into()),
            ..Default::default()
        });
        let q = promql(
            &names,
            &QueryOverrides { kv_usage: Some("my_kv_query".into()), ..Default::default() },
            "instance",
            None,
            Duration::from_secs(60),
        );
        assert!(q.contains(&(Signal::Waiting, "sum by (instance) (my_queue)".to_string())));
        assert!(q.contains(&(Signal::KvUsage, "my_kv_query".to_string())));
        assert!(q.iter().all(|(s, _)| *s != Signal::Latency && *s != Signal::Service));
    }
}
