//! The controller binary end to end against a real Prometheus (Debian's) scraping three vLLM-like
//! metrics pages of different load, and against the same pages scraped directly.

use std::process::{Command, Stdio};
use std::time::Duration;

use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::prometheus::Prometheus;
use llm_lc_testkit::{ports, wait};

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

/// Three members: idle, medium, heavily loaded.
async fn three_targets() -> Vec<MetricsTarget> {
    vec![
        // All three at their limit with a queue, the last one the slowest: it runs the fewest
        // requests, queues the most and fills its KV cache. Every policy ranks it lowest (load
        // policies by its load, the capacity policy by what it manages to run).
        MetricsTarget::vllm(1.0, 60.0, 0.50).await,
        MetricsTarget::vllm(5.0, 40.0, 0.70).await,
        MetricsTarget::vllm(12.0, 20.0, 0.95).await,
    ]
}

/// Run `llm-load-controller ARGS` to completion and parse its single JSON line.
fn run_once_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(BIN).args(args).output().expect("run controller");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line =
        stdout.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON line in: {stdout}"));
    serde_json::from_str(line).expect("valid JSON")
}

fn ratios_by_member(report: &serde_json::Value) -> Vec<(String, u64)> {
    report["pools"][0]["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| (m["member"].as_str().expect("member").to_string(), m["ratio"].as_u64().expect("ratio")))
        .collect()
}

fn assert_most_loaded_lowest(report: &serde_json::Value, targets: &[MetricsTarget]) {
    let ratios = ratios_by_member(report);
    let get = |t: &MetricsTarget| {
        ratios.iter().find(|(m, _)| *m == t.member()).map(|(_, r)| *r).expect("member present")
    };
    let (idle, mid, busy) = (get(&targets[0]), get(&targets[1]), get(&targets[2]));
    assert!(busy < mid && mid < idle, "expected busy < mid < idle, got {ratios:?}");
    let first = &report["pools"][0]["members"][2];
    assert!(first["kv_usage"].as_f64().is_some() && first["age_s"].as_f64().is_some(), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_path_gives_most_loaded_member_the_lowest_ratio() {
    let targets = three_targets().await;
    let members: Vec<String> = targets.iter().map(|t| t.member()).collect();
    let prom = Prometheus::start("vllm", &members).await;
    prom.wait_for_series("vllm:kv_cache_usage_perc", 6, Duration::from_secs(30)).await;

    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "interval: 1s\nlisten: 127.0.0.1:0\nsources:\n  prom: {{ kind: prometheus, url: '{}' }}\npools:\n  - name: llm\n    source: prom\n    selector: 'job=\"vllm\"'\n    members: {{ prometheus_up: '{{job=\"vllm\"}}' }}\n",
            prom.url()
        ),
    )
    .expect("write config");
    let report = run_once_json(&[
        "run",
        "--config",
        cfg.to_str().expect("utf8"),
        "--dry-run",
        "--once",
        "--output",
        "json",
    ]);
    assert_eq!(report["pools"][0]["state"], "ok", "{report}");
    assert_eq!(ratios_by_member(&report).len(), 3, "{report}");
    assert_most_loaded_lowest(&report, &targets);
    // Prometheus data is up to one scrape old; the sample age says so.
    let age = report["pools"][0]["members"][0]["age_s"].as_f64().expect("age");
    assert!((0.0..10.0).contains(&age), "age {age}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_quick_start_gives_most_loaded_member_the_lowest_ratio() {
    let targets = three_targets().await;
    let list = targets.iter().map(|t| t.member()).collect::<Vec<_>>().join(",");
    let report = run_once_json(&[
        "run",
        "--scrape",
        &list,
        "--listen",
        "127.0.0.1:0",
        "--dry-run",
        "--once",
        "--output",
        "json",
    ]);
    assert_most_loaded_lowest(&report, &targets);
    // Summed over the two engines of each page.
    let busy = report["pools"][0]["members"]
        .as_array()
        .expect("members")
        .iter()
        .find(|m| m["member"] == targets[2].member())
        .cloned()
        .expect("busy");
    assert_eq!(busy["waiting"].as_f64(), Some(12.0));
    assert_eq!(busy["running"].as_f64(), Some(20.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_exits_nonzero_when_no_pool_computes() {
    let dead = ports::free_port();
    let out = Command::new(BIN)
        .args([
            "run",
            "--scrape",
            &format!("127.0.0.1:{dead}"),
            "--listen",
            "127.0.0.1:0",
            "--dry-run",
            "--once",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1), "stderr: {}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_down_keeps_running_reports_and_stops_on_sigterm() {
    let dead_prom = ports::free_port();
    let listen = ports::free_port();
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "interval: 200ms\nlisten: 127.0.0.1:{listen}\nsources:\n  prom: {{ kind: prometheus, url: 'http://127.0.0.1:{dead_prom}', timeout: 1s }}\npools:\n  - name: llm\n    source: prom\n    members: {{ static: ['10.0.0.1:8000', '10.0.0.2:8000'] }}\n    sink: {{ kind: webhook, url: 'http://127.0.0.1:{dead_prom}/never' }}\n"
        ),
    )
    .expect("write config");
    let log = dir.path().join("stderr.log");
    let mut child = Command::new(BIN)
        .args(["run", "--config", cfg.to_str().expect("utf8")])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("start controller");

    let metrics_url = format!("http://127.0.0.1:{listen}/metrics");
    let client = reqwest::Client::new();
    // Several failed cycles get counted, and the controller keeps cycling.
    let text = wait::until(Duration::from_secs(20), "source errors in /metrics", || {
        let client = client.clone();
        let url = metrics_url.clone();
        async move {
            let t = client.get(&url).send().await.ok()?.text().await.ok()?;
            let errors = t
                .lines()
                .find(|l| {
                    l.starts_with("llmlc_source_errors_total{") && l.contains("reason=\"unreachable\"")
                })?
                .rsplit(' ')
                .next()?
                .parse::<f64>()
                .ok()?;
            (errors >= 3.0).then_some(t)
        }
    })
    .await;
    assert!(text.contains("llmlc_pushes_total{pool=\"llm\",sink=\"webhook\",outcome=\"held\"}"), "{text}");
    assert!(!text.contains("outcome=\"pushed\""), "nothing may be pushed while the source is down");
    let ready = client.get(format!("http://127.0.0.1:{listen}/readyz")).send().await.expect("readyz");
    assert_eq!(ready.status().as_u16(), 503);
    assert!(child.try_wait().expect("status").is_none(), "controller must keep running");

    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(status.success());
    let started = std::time::Instant::now();
    let exit = wait::until(Duration::from_secs(5), "controller to exit after SIGTERM", || {
        let r = child.try_wait().ok().flatten();
        async move { r }
    })
    .await;
    assert!(exit.success(), "exit status {exit:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let log = std::fs::read_to_string(&log).expect("log");
    assert!(log.contains("source failed") && log.contains("fail-static"), "{log}");
    assert_eq!(log.matches("source failed").count(), 1, "logged once per state change:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_quick_start_discovers_members_from_up() {
    let targets = three_targets().await;
    let members: Vec<String> = targets.iter().map(|t| t.member()).collect();
    let prom = Prometheus::start("vllm", &members).await;
    prom.wait_for_series("vllm:num_requests_waiting", 6, Duration::from_secs(30)).await;
    let report = run_once_json(&[
        "run",
        "--prometheus",
        &prom.url(),
        "--selector",
        "{job=\"vllm\"}",
        "--listen",
        "127.0.0.1:0",
        "--dry-run",
        "--once",
        "--output",
        "json",
    ]);
    assert_eq!(ratios_by_member(&report).len(), 3, "{report}");
    assert_most_loaded_lowest(&report, &targets);
}

/// `on_stale: equal`: once the pool has been blind for `reset_after`, equal ratios are pushed (here to
/// a webhook receiver); before that, nothing is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_stale_equal_pushes_equal_ratios_after_reset_after() {
    use std::sync::{Arc, Mutex};

    use axum::routing::post;
    use axum::{Json, Router};

    let received: Arc<Mutex<Vec<(std::time::Instant, serde_json::Value)>>> = Arc::default();
    let sink = received.clone();
    let app = Router::new().route(
        "/ratios",
        post(move |Json(v): Json<serde_json::Value>| {
            let sink = sink.clone();
            async move {
                if let Ok(mut g) = sink.lock() {
                    g.push((std::time::Instant::now(), v));
                }
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let hook = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });

    let dead = ports::free_port();
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "interval: 200ms\nlisten: 127.0.0.1:0\nsources:\n  s: {{ kind: scrape, timeout: 200ms }}\npools:\n  - name: p\n    source: s\n    members: {{ static: ['127.0.0.1:{dead}', '127.0.0.2:{dead}'] }}\n    on_stale: equal\n    reset_after: 2s\n    sink: {{ kind: webhook, url: 'http://{hook}/ratios' }}\n"
        ),
    )
    .expect("config");
    let started = std::time::Instant::now();
    let mut child = Command::new(BIN)
        .args(["run", "--config", cfg.to_str().expect("utf8")])
        .stderr(Stdio::null())
        .spawn()
        .expect("run");
    let (at, payload) = wait::until(Duration::from_secs(15), "equal ratios pushed", || {
        let got = received.lock().ok().and_then(|g| g.first().cloned());
        async move { got }
    })
    .await;
    let _ = child.kill();
    let _ = child.wait();
    assert!(at.duration_since(started) >= Duration::from_secs(2), "pushed before reset_after");
    let ratios = payload["ratios"].as_object().expect("ratios");
    let values: Vec<u64> = ratios.values().filter_map(|v| v.as_u64()).collect();
    assert_eq!(values.len(), 2, "{payload}");
    assert!(values[0] == values[1] && values[0] > 0, "{payload}");
}
