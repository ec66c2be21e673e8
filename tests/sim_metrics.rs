//! The simulator's `/metrics`: counts that match what happened, text that our own scrape source
//! and a real Prometheus both read in every style, and the fleet-level claim of the issue: under
//! the same load, a replica at speed 0.5 shows a longer queue and higher KV usage than the others.

use std::time::Duration;

use llm_lc_adapters::MemberId;
use llm_lc_sim::{MetricsStyle, ModelProfile};
use llm_lc_testkit::prometheus::Prometheus;
use llm_lc_testkit::sim::*;
use llm_load_controller::config::{JoinConfig, ScrapeConfig};
use llm_load_controller::source::profile::{promql, ProfileName, QueryOverrides, Signal};
use llm_load_controller::source::scrape::{self, ScrapeSource};
use llm_load_controller::source::{Join, PoolQuery, Sample};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_happened() {
    let f = fleet(ModelProfile::tiny(), &[1.0], |_| {}).await;
    let base = &f.urls()[0];
    for _ in 0..5 {
        let (s, _) = post(
            &format!("{base}/v1/completions"),
            &json!({"prompt": prompt_of(40), "max_tokens": 7}).to_string(),
        )
        .await;
        assert_eq!(s, 200);
    }
    let r = client().get(format!("{base}/metrics")).send().await.unwrap();
    assert_eq!(r.headers()["content-type"], "text/plain; version=0.0.4; charset=utf-8");
    let text = r.text().await.unwrap();
    let m = |name: &str, labels: &[&str]| {
        metric(&text, name, labels).unwrap_or_else(|| panic!("no {name}\n{text}"))
    };
    let model = "model_name=\"sim-tiny\"";
    assert_eq!(m("vllm:prompt_tokens_total", &[model, "engine=\"0\""]), 200.0);
    assert_eq!(m("vllm:generation_tokens_total", &[]), 35.0);
    assert_eq!(m("vllm:request_success_total", &["finished_reason=\"length\""]), 5.0);
    assert_eq!(m("vllm:request_success_total", &["finished_reason=\"stop\""]), 0.0);
    assert_eq!(m("vllm:time_to_first_token_seconds_count", &[]), 5.0);
    assert_eq!(m("vllm:e2e_request_latency_seconds_count", &[]), 5.0);
    assert_eq!(m("vllm:request_queue_time_seconds_count", &[]), 5.0);
    assert_eq!(m("vllm:inter_token_latency_seconds_count", &[]), 30.0);
    assert_eq!(m("vllm:time_to_first_token_seconds_bucket", &["le=\"+Inf\""]), 5.0);
    assert_eq!(m("vllm:num_requests_running", &[]), 0.0);
    assert_eq!(m("vllm:kv_cache_usage_perc", &[]), 0.0);
    assert_eq!(m("vllm:cache_config_info", &["block_size=\"16\"", "num_gpu_blocks=\"256\""]), 1.0);
    // Mean e2e in model time: 7 steps of a few ms each.
    let mean_e2e = m("vllm:e2e_request_latency_seconds_sum", &[]) / 5.0;
    assert!((0.005..0.5).contains(&mean_e2e), "mean e2e {mean_e2e}");
    // Time in the running batch: every request ran, none longer than it took end to end.
    assert_eq!(m("vllm:request_inference_time_seconds_count", &[]), 5.0);
    let mean_inference = m("vllm:request_inference_time_seconds_sum", &[]) / 5.0;
    assert!(mean_inference > 0.0 && mean_inference <= mean_e2e, "inference {mean_inference}, e2e {mean_e2e}");
}

fn pool(addrs: &[std::net::SocketAddr], profile: ProfileName) -> PoolQuery {
    PoolQuery {
        members: addrs.iter().map(|a| MemberId::new(a.to_string())).collect(),
        names: profile.metric_names(),
        queries: Vec::new(),
        join: Join::new(&JoinConfig::default()).expect("default join"),
        labels: None,
        slots: Default::default(),
    }
}

/// Our controller's own scrape source reading one pool.
async fn controller_reads(addrs: &[std::net::SocketAddr], profile: ProfileName) -> Vec<Option<Sample>> {
    let cfg: ScrapeConfig = serde_json::from_value(json!({})).expect("scrape defaults");
    let src = ScrapeSource::new("sim", &cfg).expect("scrape source");
    let p = pool(addrs, profile);
    let snap = src.sample(&[&p]).await.remove(0).expect("scrape succeeds");
    addrs.iter().map(|a| snap.members.get(&MemberId::new(a.to_string())).cloned().flatten()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_scrape_source_reads_every_style() {
    for (style, profile) in [
        (MetricsStyle::Vllm, ProfileName::Vllm),
        (MetricsStyle::VllmLegacy, ProfileName::VllmLegacy),
        (MetricsStyle::Sglang, ProfileName::Sglang),
    ] {
        // tiny: 8 sequences at most, so 10 long requests leave 2 waiting.
        let f = fleet(ModelProfile::tiny(), &[1.0], |c| {
            c.metrics_style = style;
            c.replicas[0].lora_adapters = vec!["ad".into()];
        })
        .await;
        let text = metrics_text(&f.urls()[0]).await;
        scrape::parse(&text).unwrap_or_else(|e| panic!("{style:?} does not parse: {e}\n{text}"));
        let url = format!("{}/v1/completions", f.urls()[0]);
        let streams: Vec<_> = futures::future::join_all((0..10).map(|_| {
            client()
                .post(&url)
                .json(&json!({"prompt": prompt_of(100), "max_tokens": 1800, "stream": true}))
                .send()
        }))
        .await;
        llm_lc_testkit::wait::until(Duration::from_secs(5), "8 running, 2 waiting", || async {
            let s = f.stats(0).ok()?;
            (s.running == 8 && s.waiting == 2).then_some(())
        })
        .await;
        let got = controller_reads(&f.addrs(), profile).await;
        let s = got[0].as_ref().unwrap_or_else(|| panic!("{style:?}: no sample"));
        assert_eq!((s.running, s.waiting), (8.0, 2.0), "{style:?}");
        let kv = s.kv_usage.expect("KV usage read");
        assert!(kv > 0.1 && kv <= 1.0, "{style:?} kv {kv}");
        drop(streams);
    }
}

/// Send `rate` requests per second to each replica for `secs`, at fixed intervals.
async fn steady_load(urls: Vec<String>, rate: f64, secs: f64, body: Value) {
    let client = client();
    // Every request gets a prompt of its own, of the same length: the simulator caches prefixes,
    // and a load test of queues must not be made cheaper by sharing one.
    let prompt_tokens = body["prompt"].as_str().map(|p| p.len() / 4);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut tasks = Vec::new();
    let n = (rate * secs) as usize;
    for _ in 0..n {
        tick.tick().await;
        for u in &urls {
            let mut b = body.clone();
            if let Some(tokens) = prompt_tokens {
                b["prompt"] = Value::String(prompt_of(tokens));
            }
            let (c, u, b) = (client.clone(), format!("{u}/v1/completions"), b.to_string());
            tasks.push(tokio::spawn(async move {
                let _ = c.post(u).header("content-type", "application/json").body(b).send().await;
            }));
        }
    }
    // Dropping the handles detaches the tasks: the requests stay in flight while the test reads
    // the queues.
    drop(tasks);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_replica_shows_longer_queue_and_higher_kv_in_prometheus() {
    // The fleet: three replicas, the third at half speed, the same steady load on each.
    // tiny serves ~22 req/s of 200-in/100-out at speed 1 and ~11 at 0.5: 14 req/s loads the fast
    // ones to ~60% and overloads the slow one.
    let f = fleet(ModelProfile::tiny(), &[1.0, 1.0, 0.5], |_| {}).await;
    let targets: Vec<String> = f.addrs().iter().map(|a| a.to_string()).collect();
    let prom = Prometheus::start("vllm", &targets).await;
    prom.wait_for_series("vllm:num_requests_running", 3, Duration::from_secs(30)).await;

    steady_load(f.urls(), 14.0, 8.0, json!({"prompt": prompt_of(200), "max_tokens": 100})).await;

    let by_instance = |rows: Vec<Value>| -> Vec<f64> {
        targets
            .iter()
            .map(|t| {
                rows.iter()
                    .find(|r| r["metric"]["instance"] == t.as_str())
                    .and_then(|r| r["value"][1].as_str()?.parse().ok())
                    .unwrap_or_else(|| panic!("no series for {t}: {rows:?}"))
            })
            .collect()
    };
    let waiting = by_instance(prom.query("avg_over_time(vllm:num_requests_waiting[6s])").await);
    let kv = by_instance(prom.query("avg_over_time(vllm:kv_cache_usage_perc[6s])").await);
    println!("avg waiting per replica: {waiting:?}\navg KV usage per replica: {kv:?}");
    assert!(
        waiting[2] > 2.0 && waiting[2] > 3.0 * waiting[0].max(waiting[1]).max(0.3),
        "waiting {waiting:?}"
    );
    assert!(kv[2] > 1.2 * kv[0].max(kv[1]), "kv {kv:?}");

    // The controller's PromQL for the two timings: the slow replica's requests queued, so their end
    // to end time carries the wait while their time running (vLLM's inference time) does not.
    let queries = promql(
        &ProfileName::Vllm.metric_names(),
        &QueryOverrides::default(),
        "instance",
        None,
        Duration::from_secs(60),
    );
    let query = |s: Signal| queries.iter().find(|(x, _)| *x == s).map(|(_, q)| q.clone()).expect("query");
    let latency = by_instance(prom.query(&query(Signal::Latency)).await);
    let service = by_instance(prom.query(&query(Signal::Service)).await);
    println!("mean e2e per replica: {latency:?}\nmean time running per replica: {service:?}");
    for i in 0..3 {
        assert!(service[i] > 0.0 && service[i] <= latency[i] + 1e-9, "service {service:?} e2e {latency:?}");
    }
    assert!(latency[2] > 1.5 * service[2], "the queue's wait is in e2e only: {latency:?} vs {service:?}");
    // The prefix-cache share through PromQL: every prompt here is new, so nothing is found.
    let cached = by_instance(prom.query(&query(Signal::PromptCached)).await);
    assert!(cached.iter().all(|c| (0.0..0.05).contains(c)), "prefix cache share {cached:?}");

    // The controller's own direct scrape sees the same picture right now.
    let now = controller_reads(&f.addrs(), ProfileName::Vllm).await;
    let w: Vec<f64> = now.iter().map(|s| s.as_ref().expect("sample").waiting).collect();
    assert!(w[2] > w[0] && w[2] > w[1], "direct scrape waiting {w:?}");

    // Prometheus scraped every target cleanly.
    let targets_api: Value =
        client().get(format!("{}/api/v1/targets", prom.url())).send().await.unwrap().json().await.unwrap();
    for t in targets_api["data"]["activeTargets"].as_array().unwrap() {
        assert_eq!(t["health"], "up", "{t}");
        assert_eq!(t["lastError"], "", "{t}");
    }
    // Histograms work as histograms in PromQL.
    let q =
        prom.query("histogram_quantile(0.5, sum by (le) (vllm:time_to_first_token_seconds_bucket))").await;
    let p50: f64 = q[0]["value"][1].as_str().unwrap().parse().unwrap();
    assert!(p50.is_finite() && p50 > 0.0, "TTFT p50 {p50}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_prometheus_parses_every_style() {
    let mut fleets = Vec::new();
    for style in [MetricsStyle::Vllm, MetricsStyle::VllmLegacy, MetricsStyle::Sglang] {
        let f = fleet(ModelProfile::tiny(), &[1.0], |c| {
            c.metrics_style = style;
            c.replicas[0].lora_adapters = vec!["sql-lora".into()];
        })
        .await;
        let (s, _) = post(
            &format!("{}/v1/completions", f.urls()[0]),
            &json!({"prompt": "x", "max_tokens": 3}).to_string(),
        )
        .await;
        assert_eq!(s, 200);
        fleets.push(f);
    }
    let targets: Vec<String> = fleets.iter().map(|f| f.addrs()[0].to_string()).collect();
    let prom = Prometheus::start("styles", &targets).await;
    prom.wait_for_series("up == 1", 3, Duration::from_secs(30)).await;
    prom.wait_for_series("scrape_samples_scraped > 50", 3, Duration::from_secs(30)).await;
    let targets_api: Value =
        client().get(format!("{}/api/v1/targets", prom.url())).send().await.unwrap().json().await.unwrap();
    for t in targets_api["data"]["activeTargets"].as_array().unwrap() {
        assert_eq!(t["lastError"], "", "{t}");
    }
    for q in [
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "vllm:lora_requests_info",
        "vllm:generation_tokens_total",
        "sglang:generation_tokens_total",
    ] {
        assert!(!prom.query(q).await.is_empty(), "Prometheus has no {q}");
    }
    let gen: f64 = prom.query("sum(vllm:generation_tokens_total)").await[0]["value"][1]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(gen, 6.0, "vllm and vllm-legacy replicas produced 3 tokens each");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_scrape_source_reads_the_time_running_and_queued_beside_the_end_to_end_time() {
    // tiny runs 8 sequences at most: 12 requests at once leave 4 queued behind the first 8, so
    // the mean end-to-end time carries a wait that the time running does not.
    let f = fleet(ModelProfile::tiny(), &[1.0], |_| {}).await;
    let cfg: ScrapeConfig = serde_json::from_value(json!({})).expect("scrape defaults");
    let src = ScrapeSource::new("sim", &cfg).expect("scrape source");
    let p = pool(&f.addrs(), ProfileName::Vllm);
    let member = MemberId::new(f.addrs()[0].to_string());
    let read = || async {
        let snap = src.sample(&[&p]).await.remove(0).expect("scrape succeeds");
        snap.members.get(&member).cloned().flatten().expect("sample")
    };
    let before = read().await;
    assert_eq!(
        (before.latency, before.service, before.queue_time),
        (None, None, None),
        "timings need two scrapes"
    );
    let url = format!("{}/v1/completions", f.urls()[0]);
    let answers = futures::future::join_all(
        (0..12).map(|_| client().post(&url).json(&json!({"prompt": prompt_of(50), "max_tokens": 60})).send()),
    )
    .await;
    assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|r| r.status() == 200)));
    let after = read().await;
    let (e2e, running) = (after.latency.expect("e2e time"), after.service.expect("time running"));
    assert!(running > 0.0 && running < e2e, "time running {running} s, end to end {e2e} s");
    // The 4 that waited give the queue histogram its mass; queued plus running is the whole
    // stay, up to the prefill step that vLLM counts in neither.
    let queued = after.queue_time.expect("time queued");
    assert!(queued > 0.0, "4 of 12 waited: {queued} s");
    assert!(
        (queued + running - e2e).abs() <= 0.1 * e2e,
        "queued {queued} s + running {running} s against end to end {e2e} s"
    );
}

/// The llama.cpp-shaped server reads through our `llamacpp` profile as the real one does: busy
/// slots and the queue from its gauges, the slot count from `GET /props`, no KV gauge, and the
/// time per generated token from its counters once requests end. Other styles have no `/props`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_scrape_source_reads_the_llamacpp_style_and_its_props() {
    let f = fleet(ModelProfile::llamacpp_cpu(), &[1.0], |c| {
        c.metrics_style = MetricsStyle::Llamacpp;
        c.replicas[0].slots = Some(2);
    })
    .await;
    let base = f.urls()[0].clone();
    let props: Value = client().get(format!("{base}/props")).send().await.unwrap().json().await.unwrap();
    assert_eq!(
        (props["total_slots"].as_u64(), props["default_generation_settings"]["n_ctx"].as_u64()),
        (Some(2), Some(1024))
    );
    let url = format!("{base}/v1/completions");
    let long = json!({"prompt": prompt_of(40), "max_tokens": 900, "ignore_eos": true, "stream": true});
    let streams: Vec<_> =
        futures::future::join_all((0..5).map(|_| client().post(&url).json(&long).send())).await;
    llm_lc_testkit::wait::until(Duration::from_secs(5), "2 running, 3 deferred", || async {
        let s = f.stats(0).ok()?;
        (s.running == 2 && s.waiting == 3).then_some(())
    })
    .await;
    let got = controller_reads(&f.addrs(), ProfileName::Llamacpp).await;
    let s = got[0].as_ref().expect("a sample");
    assert_eq!((s.running, s.waiting, s.slots, s.kv_usage), (2.0, 3.0, Some(2.0), None));
    drop(streams);
    // The speed counters move when requests end: two readings around a few short requests.
    let cfg: ScrapeConfig = serde_json::from_value(json!({})).expect("scrape defaults");
    let src = ScrapeSource::new("sim", &cfg).expect("scrape source");
    let p = pool(&f.addrs(), ProfileName::Llamacpp);
    llm_lc_testkit::wait::until(Duration::from_secs(10), "the aborted requests to leave", || async {
        (f.stats(0).ok()?.running == 0).then_some(())
    })
    .await;
    src.sample(&[&p]).await.remove(0).expect("first reading");
    for _ in 0..3 {
        let (status, _) = post(&url, &json!({"prompt": prompt_of(40), "max_tokens": 20}).to_string()).await;
        assert_eq!(status, 200);
    }
    let snap = src.sample(&[&p]).await.remove(0).expect("second reading");
    let t = snap.members.values().next().cloned().flatten().and_then(|s| s.token_time).expect("token time");
    // The profile's batch-1 step is 1.6 ms: generation plus prompt seconds per generated token.
    assert!((1.5e-3..5e-3).contains(&t), "seconds per generated token {t}");

    let vllm = fleet(ModelProfile::tiny(), &[1.0], |_| {}).await;
    let r = client().get(format!("{}/props", vllm.urls()[0])).send().await.unwrap();
    assert_eq!(r.status(), 404, "vLLM has no /props");
}

/// The simulated servers cache prefixes: a prompt sent twice is found the second time, in whole
/// 16-token blocks short of the last token, and each style publishes it under its engine's name.
#[tokio::test]
async fn a_repeated_prompt_is_served_from_the_prefix_cache_and_counted() {
    for (style, hits_metric) in [
        (MetricsStyle::Vllm, "vllm:prefix_cache_hits_total"),
        (MetricsStyle::Llamacpp, "llamacpp:prompt_tokens_cached_total"),
    ] {
        let f = fleet(ModelProfile::tiny(), &[1.0], |c| c.metrics_style = style).await;
        let url = format!("{}/v1/completions", f.urls()[0]);
        for prompt in [shared_prompt_of(200), shared_prompt_of(200), prompt_of(200)] {
            let r = client()
                .post(&url)
                .json(&json!({"prompt": prompt, "max_tokens": 2}))
                .send()
                .await
                .expect("completion");
            assert!(r.status().is_success(), "{style:?}: {}", r.status());
            r.text().await.expect("body");
        }
        let text = metrics_text(&f.urls()[0]).await;
        let hits = metric(&text, hits_metric, &[]).unwrap_or_else(|| panic!("{hits_metric} in\n{text}"));
        // 200 tokens = 12 full blocks and 8 tokens: the second copy finds 12 x 16; the third,
        // different from its first characters, finds nothing.
        assert_eq!(hits, 192.0, "{style:?}");
        if style == MetricsStyle::Vllm {
            assert_eq!(metric(&text, "vllm:prefix_cache_queries_total", &[]), Some(600.0));
        }
    }
}

/// The family a sample belongs to on an exposition page, its TYPE, and the label names of its
/// first series (without `le`), or `None` when the page has no such sample.
fn shape_of(page: &str, sample: &str) -> Option<(String, std::collections::BTreeSet<String>)> {
    let line = page.lines().find(|l| {
        !l.starts_with('#') && l.starts_with(sample) && l[sample.len()..].starts_with(['{', ' '])
    })?;
    let inner =
        line.split_once('{').and_then(|(_, rest)| rest.split_once('}')).map_or("", |(inner, _)| inner);
    let labels = inner
        .split(',')
        .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim().to_string()))
        .filter(|k| k != "le")
        .collect();
    // The TYPE line of the family: the sample itself, or the sample less a histogram suffix.
    let kind = page.lines().find_map(|l| {
        let rest = l.strip_prefix("# TYPE ")?;
        let (family, kind) = rest.split_once(' ')?;
        let ok = family == sample
            || ["_sum", "_count", "_bucket"].iter().any(|s| sample.strip_suffix(s) == Some(family));
        ok.then(|| kind.trim().to_string())
    })?;
    Some((kind, labels))
}

/// Every series the `vllm` profile reads is on a real vLLM 0.32 page (a fixture captured from
/// `tests/vllm/serve.sh`, under load) and on the simulator's, with the same TYPE, the same label
/// names and the same units (KV usage a fraction on both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulated_vllm_page_reads_like_a_real_vllm_0_32_page() {
    let real = include_str!("vllm/fixtures/metrics-0.32.0-busy.txt");
    let f = fleet(ModelProfile::tiny(), &[1.0], |_| {}).await;
    let base = &f.urls()[0];
    let (s, _) = post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": prompt_of(40), "max_tokens": 7}).to_string(),
    )
    .await;
    assert_eq!(s, 200);
    let sim = client().get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    let names = ProfileName::Vllm.metric_names();
    let mut read: Vec<String> = Vec::new();
    read.extend(names.waiting.iter().take(1).cloned());
    read.extend(names.running.iter().take(1).cloned());
    read.extend(names.kv_usage.iter().take(1).cloned());
    for h in names.latency_histogram.iter().chain(&names.service_histogram).chain(&names.queue_histogram) {
        read.push(format!("{h}_sum"));
        read.push(format!("{h}_count"));
    }
    for r in names.prompt_cached.iter() {
        read.extend(r.counters().cloned());
    }
    assert!(read.len() >= 10, "{read:?}");
    for name in &read {
        let r = shape_of(real, name).unwrap_or_else(|| panic!("real vLLM has no {name}"));
        let s = shape_of(&sim, name).unwrap_or_else(|| panic!("the simulator has no {name}"));
        assert_eq!(s, r, "{name}: simulator {s:?}, real vLLM {r:?}");
    }
    // KV usage is a fraction on both (not a percentage, whatever `_perc` says).
    let kv = |page: &str| metric(page, "vllm:kv_cache_usage_perc", &[]).expect("kv usage");
    assert!((0.0..=1.0).contains(&kv(real)) && (0.0..=1.0).contains(&kv(&sim)));
    // The busy fixture shows what the policy learns the batch limit from: 1 running, 5 waiting.
    assert_eq!(
        (metric(real, "vllm:num_requests_running", &[]), metric(real, "vllm:num_requests_waiting", &[])),
        (Some(1.0), Some(5.0))
    );
}
