//! The direct-scrape source against real HTTP servers on loopback: odd-but-valid pages are read, huge
//! pages neither stall the cycle nor get past the cap, failing members are reported with a reason,
//! and the reader's cost per page is measured (`--ignored` bench).

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use llm_lc_adapters::MemberId;
use llm_lc_testkit::metrics_target::{vllm_text, MetricsTarget};
use llm_lc_testkit::ports;
use llm_load_controller::config::{JoinConfig, ScrapeConfig};
use llm_load_controller::source::exposition::{read, Wanted, DEFAULT_MAX_BYTES};
use llm_load_controller::source::profile::ProfileName;
use llm_load_controller::source::scrape::{wanted, ScrapeSource};
use llm_load_controller::source::{FailureReason, Join, PoolQuery};

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

fn source(yaml: &str) -> ScrapeSource {
    let cfg: ScrapeConfig = serde_yaml_ng::from_str(yaml).expect("config");
    ScrapeSource::new("test", &cfg).expect("source")
}

fn pool(members: &[String]) -> PoolQuery {
    PoolQuery {
        members: members.iter().map(|m| MemberId::from(m.as_str())).collect(),
        names: ProfileName::Vllm.metric_names(),
        queries: vec![],
        join: Join::new(&JoinConfig::default()).expect("join"),
        labels: None,
        slots: Default::default(),
    }
}

/// A page Prometheus ingests but strict parsers refuse: no TYPE lines for the load gauges, one family
/// whose samples have different label names, a duplicated series, escaped label values with braces
/// and commas, `_total`/`_created` twins, timestamps, an OpenMetrics exemplar and `# EOF`.
const ODD_PAGE: &str = concat!(
    "# HELP process_cpu_seconds_total Total user and system CPU time.\n",
    "# TYPE process_cpu_seconds_total counter\n",
    "process_cpu_seconds_total 12.5\n",
    "build_info{version=\"1\"} 1\n",
    "build_info{commit=\"abc\",branch=\"main\"} 1\n",
    "build_info{version=\"1\"} 1\n",
    "vllm:num_requests_waiting{engine=\"0\",model_name=\"m \\\"x\\\" {a,b}\"} 4\n",
    "vllm:num_requests_waiting{engine=\"1\",model_name=\"m \\\"x\\\" {a,b}\"} 2 1700000000000\n",
    "vllm:num_requests_waiting{model_name=\"m \\\"x\\\" {a,b}\",engine=\"1\"} 2\n",
    "vllm:num_requests_running{engine=\"0\"} 7\n",
    "vllm:num_requests_running{engine=\"1\",extra=\"hand-written\"} 1\n",
    "vllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n",
    "vllm:kv_cache_usage_perc{engine=\"1\"} 0.75\n",
    "vllm:request_success_total{engine=\"0\"} 9\n",
    "vllm:request_success_created{engine=\"0\"} 1.7e9\n",
    "vllm:e2e_request_latency_seconds_count{engine=\"0\"} 4 # {trace_id=\"t\"} 1.5\n",
    "vllm:e2e_request_latency_seconds_sum{engine=\"0\"} 6\n",
    "vllm:e2e_request_latency_seconds_created{engine=\"0\"} 1.7e9\n",
    "# EOF\n",
);

#[tokio::test]
async fn odd_but_valid_page_is_read() {
    let t = MetricsTarget::start(ODD_PAGE).await;
    let p = pool(&[t.member()]);
    let snap = source("{}").sample(&[&p]).await.remove(0).expect("sampled");
    let s = snap.members[&MemberId::from(t.member().as_str())].as_ref().expect("the odd page is read");
    assert_eq!((s.waiting, s.running), (6.0, 8.0), "duplicate counted once, engines summed");
    assert_eq!(s.kv_usage, Some(0.5));
    assert!(snap.failures.is_empty(), "{:?}", snap.failures);
}

/// A page of `n` unrelated series (an exporter merging registries) with the vLLM gauges at the end.
fn huge_page(n: usize, waiting: f64) -> String {
    let mut s = String::with_capacity(n * 90);
    s.push_str("# TYPE http_server_requests_seconds histogram\n");
    for i in 0..n {
        s.push_str(&format!(
            "http_server_requests_seconds_bucket{{method=\"GET\",path=\"/api/v1/item/{i}\",status=\"200\",le=\"0.5\"}} {i}\n"
        ));
    }
    s.push_str(&vllm_text(waiting, 4.0, 0.5));
    s
}

#[tokio::test]
async fn failing_members_are_reported_with_a_bounded_reason_and_the_rest_still_read() {
    let ok = MetricsTarget::vllm(1.0, 2.0, 0.1).await;
    let big = MetricsTarget::start(&huge_page(60_000, 1.0)).await; // ~5 MB, past the 4 MiB default
    let broken = MetricsTarget::start("vllm:num_requests_waiting{engine=\"0\" 3\n").await;
    let wrong_profile = MetricsTarget::start("sglang:num_queue_reqs 3\n").await;
    let dead = format!("127.0.0.1:{}", ports::free_port());
    let p = pool(&[ok.member(), big.member(), broken.member(), wrong_profile.member(), dead.clone()]);
    let snap = source("{}").sample(&[&p]).await.remove(0).expect("one member answered");
    assert!(snap.members[&MemberId::from(ok.member().as_str())].is_some());
    let reason = |m: &str| {
        snap.failures.iter().find(|f| f.member.as_str() == m).map(|f| f.reason).unwrap_or_else(|| {
            panic!("{m} not in failures: {:?}", snap.failures);
        })
    };
    assert_eq!(reason(&big.member()), FailureReason::TooLarge);
    assert_eq!(reason(&broken.member()), FailureReason::Unreadable);
    assert_eq!(reason(&wrong_profile.member()), FailureReason::NoSeries);
    assert_eq!(reason(&dead), FailureReason::Unreachable);
    assert_eq!(snap.failures.len(), 4, "{:?}", snap.failures);
    let big_detail = &snap.failures.iter().find(|f| f.member.as_str() == big.member()).expect("big").detail;
    assert!(big_detail.contains(&DEFAULT_MAX_BYTES.to_string()), "{big_detail}");
    // The cap is configurable.
    let snap = source("max_body_bytes: 8000000").sample(&[&p]).await.remove(0).expect("sampled");
    assert!(snap.members[&MemberId::from(big.member().as_str())].is_some(), "read under a larger cap");
}

#[tokio::test]
async fn http_errors_and_timeouts_have_their_own_reasons() {
    use axum::routing::get;
    let app = axum::Router::new()
        .route("/metrics", get(|| async { (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "boom") }))
        .route(
            "/slow/metrics",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                "late"
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let ok = MetricsTarget::vllm(1.0, 2.0, 0.1).await;
    let snap = source("timeout: 300ms")
        .sample(&[&pool(&[ok.member(), addr.clone()])])
        .await
        .remove(0)
        .expect("sampled");
    assert_eq!(snap.failures.len(), 1);
    assert_eq!(snap.failures[0].reason, FailureReason::HttpStatus, "{:?}", snap.failures);
    assert!(snap.failures[0].detail.contains("500"), "{:?}", snap.failures);
    let started = Instant::now();
    let snap = source("timeout: 300ms\npath: /slow/metrics").sample(&[&pool(&[addr])]).await.remove(0);
    assert!(started.elapsed() < Duration::from_secs(2), "timeout applies");
    // The only member failed: the pool's sampling fails, with the reason visible in the error.
    let e = snap.expect_err("only member timed out");
    assert!(e.to_string().contains("timed out"), "{e}");
}

/// The reproducer: a 1.7 MB page (17,000 series) next to normal members, interval 1 s. The
/// old parser took ~33 s for such a page inside the cycle; now cycles keep their pace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_page_next_to_normal_members_keeps_one_cycle_per_second() {
    let page = huge_page(17_000, 3.0);
    assert!((1_600_000..2_000_000).contains(&page.len()), "{} bytes", page.len());
    let big = MetricsTarget::start(&page).await;
    let a = MetricsTarget::vllm(0.0, 2.0, 0.1).await;
    let b = MetricsTarget::vllm(8.0, 40.0, 0.9).await;
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "interval: 1s\nlisten: 127.0.0.1:0\nsources:\n  s: {{ kind: scrape }}\npools:\n  - name: p\n    source: s\n    members: {{ static: ['{}', '{}', '{}'] }}\n",
            big.member(),
            a.member(),
            b.member()
        ),
    )
    .expect("config");
    let mut child = Command::new(BIN)
        .args(["run", "--config", cfg.to_str().expect("utf8"), "--dry-run", "--output", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start controller");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    let window = Duration::from_secs(5);
    let started = Instant::now();
    let mut reports = Vec::new();
    while started.elapsed() < window {
        if let Ok((at, line)) = rx.recv_timeout(window.saturating_sub(started.elapsed())) {
            if line.starts_with('{') {
                reports.push((at, line));
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    // A cycle at once, then one per second: at least 4 in 5 s even with start-up time.
    assert!(reports.len() >= 4, "only {} cycles in {window:?}", reports.len());
    let last: serde_json::Value = serde_json::from_str(&reports.last().expect("report").1).expect("json");
    let members = last["pools"][0]["members"].as_array().expect("members");
    let big_member = members.iter().find(|m| m["member"] == big.member()).expect("big member reported");
    assert_eq!(big_member["waiting"].as_f64(), Some(3.0), "the huge page is read, not skipped: {last}");
    assert_eq!(members.iter().filter(|m| m["waiting"].is_number()).count(), 3, "{last}");
}

/// A vLLM v1 page as a single-engine server prints it (~25 KB, more than the issue's ~15 KB example): gauges, counters with `_created`
/// twins, and the histograms, with HELP/TYPE lines.
fn ordinary_vllm_page() -> String {
    let mut s = String::new();
    let l = "engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"";
    for (name, v) in [
        ("vllm:num_requests_running", 12.0),
        ("vllm:num_requests_waiting", 3.0),
        ("vllm:kv_cache_usage_perc", 0.42),
    ] {
        s.push_str(&format!("# HELP {name} A gauge.\n# TYPE {name} gauge\n{name}{{{l}}} {v}\n"));
    }
    for name in [
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
    ] {
        s.push_str(&format!(
            "# HELP {name}_total A counter.\n# TYPE {name}_total counter\n{name}_total{{{l}}} 123456.0\n\
             # HELP {name}_created A counter.\n# TYPE {name}_created gauge\n{name}_created{{{l}}} 1.7e9\n"
        ));
    }
    for reason in ["stop", "length", "abort"] {
        s.push_str(&format!("vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} 42.0\n"));
    }
    let buckets: &[(&str, &[f64])] = &[
        (
            "vllm:time_to_first_token_seconds",
            &[
                0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
            ],
        ),
        (
            "vllm:inter_token_latency_seconds",
            &[
                0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0,
            ],
        ),
        (
            "vllm:e2e_request_latency_seconds",
            &[
                0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0,
            ],
        ),
        (
            "vllm:request_queue_time_seconds",
            &[
                0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0,
            ],
        ),
        (
            "vllm:request_prefill_time_seconds",
            &[
                0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0,
            ],
        ),
        (
            "vllm:request_decode_time_seconds",
            &[
                0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0,
            ],
        ),
        (
            "vllm:request_prompt_tokens",
            &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0],
        ),
        (
            "vllm:request_generation_tokens",
            &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0],
        ),
    ];
    for (name, bounds) in buckets {
        s.push_str(&format!("# HELP {name} A histogram.\n# TYPE {name} histogram\n"));
        for (i, b) in bounds.iter().enumerate() {
            s.push_str(&format!("{name}_bucket{{{l},le=\"{b:?}\"}} {}.0\n", i * 3));
        }
        s.push_str(&format!(
            "{name}_bucket{{{l},le=\"+Inf\"}} 100.0\n{name}_count{{{l}}} 100.0\n{name}_sum{{{l}}} 523.25\n"
        ));
        s.push_str(&format!(
            "# HELP {name}_created A histogram.\n# TYPE {name}_created gauge\n{name}_created{{{l}}} 1.7e9\n"
        ));
    }
    s
}

/// Cost of reading one page, CPU time per page on this machine. Run with
/// `cargo test --release --test scrape_source -- --ignored --nocapture reader_cost`.
#[test]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
fn reader_cost_per_page() {
    let mut w = Wanted::default();
    wanted(&ProfileName::Vllm.metric_names(), &mut w);
    let mut results = Vec::new();
    for (label, page, iterations) in [
        ("ordinary vLLM page", ordinary_vllm_page(), 20_000u32),
        ("17k-series 1.7 MB page", huge_page(17_000, 3.0), 50),
    ] {
        // Warm up, then time.
        for _ in 0..10 {
            read(page.as_bytes(), w.clone(), usize::MAX).expect("reads");
        }
        let started = Instant::now();
        for _ in 0..iterations {
            let r = read(std::hint::black_box(page.as_bytes()), w.clone(), usize::MAX).expect("reads");
            assert_eq!(r.get("vllm:num_requests_waiting").map(|t| t.sum), Some(3.0));
        }
        let per = started.elapsed() / iterations;
        println!("{label}: {} bytes, {per:?} per page", page.len());
        results.push(per);
    }
    if !cfg!(debug_assertions) {
        assert!(results[0] < Duration::from_micros(50), "ordinary page took {:?}", results[0]);
    }
}

#[test]
fn ordinary_page_is_15_to_30_kb_and_reads() {
    let page = ordinary_vllm_page();
    assert!((15_000..30_000).contains(&page.len()), "{} bytes", page.len());
    let mut w = Wanted::default();
    wanted(&ProfileName::Vllm.metric_names(), &mut w);
    let r = read(page.as_bytes(), w, DEFAULT_MAX_BYTES).expect("reads");
    assert_eq!(r.get("vllm:e2e_request_latency_seconds_sum").map(|t| t.sum), Some(523.25));
    assert_eq!(r.get("vllm:kv_cache_usage_perc").map(|t| t.mean()), Some(0.42));
}

fn timed_page(count: f64, e2e_sum: f64, run_sum: f64) -> String {
    format!(
        "{}vllm:e2e_request_latency_seconds_sum {e2e_sum}\nvllm:e2e_request_latency_seconds_count {count}\n\
         vllm:request_inference_time_seconds_sum {run_sum}\nvllm:request_inference_time_seconds_count {count}\n",
        vllm_text(2.0, 8.0, 0.5)
    )
}

/// A member in two pools is fetched once per cycle, and both pools get the same window's means: the
/// counters' baseline moves once per sample, not once per pool (the second pool used to see a
/// zero-length window and no timings at all). A member that left starts afresh when it returns.
#[tokio::test]
async fn a_member_in_two_pools_gets_its_timings_in_both_and_a_returning_one_starts_afresh() {
    let t = MetricsTarget::start(&timed_page(10.0, 20.0, 10.0)).await;
    let (a, b) = (pool(&[t.member()]), pool(&[t.member()]));
    let src = source("{}");
    src.sample(&[&a, &b]).await;
    // 10 more requests: 3 s end to end and 1.5 s running each.
    t.set(&timed_page(20.0, 50.0, 25.0));
    let snaps = src.sample(&[&a, &b]).await;
    let id = MemberId::from(t.member().as_str());
    for (i, snap) in snaps.into_iter().enumerate() {
        let snap = snap.expect("sampled");
        let s = snap.members[&id].as_ref().expect("read");
        assert_eq!((s.latency, s.service), (Some(3.0), Some(1.5)), "pool {i}");
    }
    // The member leaves every pool and comes back: its first reading starts a new window instead of
    // averaging over its whole absence.
    src.sample(&[&pool(&[])]).await;
    t.set(&timed_page(30.0, 100.0, 30.0));
    let snap = src.sample(&[&a]).await.remove(0).expect("sampled");
    let s = snap.members[&id].as_ref().expect("read");
    assert_eq!((s.latency, s.service), (None, None), "a new window after coming back");
}

/// Real vLLM 0.32 pages (`tests/vllm/fixtures/`, captured from `tests/vllm/serve.sh`): one without
/// `vllm:cache_config_info` and with its labels renamed reads the same, and a server that restarted
/// between two readings (its counters fell from 9 requests to 0) gives no timing rather than a
/// negative one, then a fresh window from the restart on.
#[tokio::test]
async fn a_real_vllm_page_is_read_from_what_it_has_and_a_restart_is_no_negative_rate() {
    let quiet = include_str!("vllm/fixtures/metrics-0.32.0.txt");
    let busy = include_str!("vllm/fixtures/metrics-0.32.0-busy.txt");
    let stripped: String = busy
        .lines()
        .filter(|l| !l.contains("vllm:cache_config_info"))
        .map(|l| l.replace("model_name=", "served_model=").replace("engine=", "engine_index=") + "\n")
        .collect();
    for page in [busy, stripped.as_str()] {
        let t = MetricsTarget::start(page).await;
        let snap = source("{}").sample(&[&pool(&[t.member()])]).await.remove(0).expect("sampled");
        let s = snap.members[&MemberId::from(t.member().as_str())].as_ref().expect("read");
        assert_eq!((s.waiting, s.running), (5.0, 1.0));
        assert!(s.kv_usage.is_some_and(|kv| (kv - 0.00787).abs() < 1e-4), "{:?}", s.kv_usage);
    }
    let t = MetricsTarget::start(quiet).await;
    let (src, p, id) = (source("{}"), pool(&[t.member()]), MemberId::from(t.member().as_str()));
    src.sample(&[&p]).await;
    t.set(busy);
    let snap = src.sample(&[&p]).await.remove(0).expect("sampled");
    let s = snap.members[&id].as_ref().expect("read after the restart");
    assert_eq!((s.latency, s.service, s.queue_time), (None, None, None), "counters fell: no window");
    t.set(quiet);
    let snap = src.sample(&[&p]).await.remove(0).expect("sampled");
    let s = snap.members[&id].as_ref().expect("read");
    let latency = s.latency.expect("a window from the restart on");
    assert!((latency - 4.5651633739471436 / 9.0).abs() < 1e-9, "{latency}");
}
