//! What outside input can do to the controller and the proxy, tried from the outside: the request
//! an attacker (or an unlucky day) sends, or the slow server it runs, against the real binary. Each
//! test is the case that broke before its fix: a discovery request naming one cluster 30,000 times,
//! pollers with megabyte node ids, a member that answers slowly, a ratio of 10^8, megabyte member
//! names, members that churn while the metric queries miss the cycle's deadline.

use std::time::Duration;

use llm_lc_testkit::controller::Running;
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::wait;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");
const CLA: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
/// The memory limit of `deploy/openshift/base`, as an address-space cap on the process.
const CAP: u64 = 256 << 20;

fn envoy_pool(member: &str) -> String {
    format!(
        "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    \
         members: {{ static: ['{member}'] }}\n    sink: {{ kind: envoy, cluster: vllm }}\n"
    )
}

/// POST a discovery request to the controller's REST EDS endpoint: (status, body length, body).
async fn discover(run: &Running, body: &serde_json::Value) -> Option<(u16, usize, String)> {
    let url = format!("http://127.0.0.1:{}/v3/discovery:endpoints", run.listen());
    let resp = reqwest::Client::new().post(url).json(body).send().await.ok()?;
    let status = resp.status().as_u16();
    let text = resp.text().await.ok()?;
    Some((status, text.len(), text))
}

async fn serving_vllm(run: &Running) {
    let one = json!({"resource_names": ["vllm"], "type_url": CLA, "node": {"id": "edge"}});
    wait::until(Duration::from_secs(30), "the controller to serve cluster vllm", || async {
        (discover(run, &one).await?.0 == 200).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovery_request_repeating_one_cluster_gets_one_copy_or_a_short_refusal() {
    let target = MetricsTarget::vllm(0.0, 2.0, 0.1).await;
    let mut run =
        Running::start_capped(std::path::Path::new(BIN), "300ms", &envoy_pool(&target.member()), Some(CAP));
    serving_vllm(&run).await;
    let (_, one_len, _) =
        discover(&run, &json!({"resource_names": ["vllm"], "type_url": CLA})).await.expect("one");

    // 30,000 repeats: a 175 MB answer before, and an abort under the cap at 10,000.
    for repeats in [30_000, 10_000] {
        let flood = json!({"resource_names": vec!["vllm"; repeats], "type_url": CLA});
        let (status, len, text) = discover(&run, &flood).await.expect("an answer");
        assert_eq!(status, 400, "{text}");
        assert!(len < 300, "a short refusal, not {len} bytes: {text}");
        assert!(text.contains(&repeats.to_string()), "says how many were named: {text}");
    }
    // Repeats an Envoy could send are answered with the cluster once.
    let many = json!({"resource_names": vec!["vllm"; 4000], "type_url": CLA});
    let (status, len, text) = discover(&run, &many).await.expect("an answer");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["resources"].as_array().map(Vec::len), Some(1));
    assert_eq!(len, one_len, "the same answer as naming it once");
    assert!(run.alive(), "the controller survived; its log:\n{}", run.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_hundred_pollers_with_megabyte_node_ids_leave_little_behind() {
    let target = MetricsTarget::vllm(0.0, 2.0, 0.1).await;
    let mut run =
        Running::start_capped(std::path::Path::new(BIN), "300ms", &envoy_pool(&target.member()), Some(CAP));
    serving_vllm(&run).await;
    let huge = "n".repeat(1 << 20);
    for i in 0..600 {
        let poll = json!({"resource_names": ["vllm"], "type_url": CLA, "version_info": "v",
                          "node": {"id": format!("{i}-{huge}")}});
        let (status, _, _) = discover(&run, &poll).await.expect("an answer");
        assert_eq!(status, 200, "poll {i}");
    }
    assert!(run.alive(), "the controller survived 600 polls; its log:\n{}", run.log());
    // Before: 256 ids of 1 MiB kept (567 MB peak). Now a few hundred bytes each, and one request's
    // worth of parsing at a time.
    let peak = run.peak_rss().expect("VmHWM");
    assert!(peak < 96 << 20, "peak resident memory {} MiB", peak >> 20);
}

/// The proxy binary (`proxy --config`) in front of a small simulated fleet, its log in a file.
struct ProxyProcess {
    child: std::process::Child,
    dir: tempfile::TempDir,
    api: u16,
    admin: u16,
    _fleet: llm_lc_sim::Fleet,
}

impl ProxyProcess {
    async fn start(algorithm: &str) -> ProxyProcess {
        use llm_lc_testkit::{ports, proxy};
        let fleet = proxy::fleet(proxy::constant_profile(), 2, &["m"], &[], 20.0).await;
        let members = proxy::members_yaml(&fleet.addrs());
        let (api, admin) = (ports::free_port(), ports::free_port());
        let dir = tempfile::tempdir().expect("tmp");
        let cfg = dir.path().join("proxy.yaml");
        std::fs::write(
            &cfg,
            format!(
                "listen: 127.0.0.1:{api}\nadmin: {{ listen: 127.0.0.1:{admin} }}\npools:\n  - name: llm\n    \
                 members: {members}\n    algorithm: {algorithm}\nroutes:\n  steps:\n    - id: model\n      \
                 field: model\n      op: exists\n      match: {{ pool: llm }}\n      miss: {{ reject: 400 }}\n"
            ),
        )
        .expect("config");
        let child = std::process::Command::new(BIN)
            .args(["proxy", "--config"])
            .arg(&cfg)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr.log")).expect("log"))
            .spawn()
            .expect("start proxy");
        let p = ProxyProcess { child, dir, api, admin, _fleet: fleet };
        wait::until(Duration::from_secs(30), "the proxy's admin listener", || async {
            reqwest::get(format!("http://127.0.0.1:{}/healthz", p.admin))
                .await
                .ok()?
                .status()
                .is_success()
                .then_some(())
        })
        .await;
        p
    }

    async fn post_ratios(&self, body: &serde_json::Value) -> (u16, String) {
        let resp = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{}/admin/ratios", self.admin))
            .json(body)
            .send()
            .await
            .expect("admin answers");
        (resp.status().as_u16(), resp.text().await.unwrap_or_default())
    }

    async fn completes(&self) -> bool {
        let body = json!({"model": "m", "prompt": "hello there", "max_tokens": 4});
        let resp = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{}/v1/completions", self.api))
            .json(&body)
            .send()
            .await;
        matches!(resp, Ok(r) if r.status().is_success())
    }

    fn log_bytes(&self) -> u64 {
        std::fs::metadata(self.dir.path().join("stderr.log")).map(|m| m.len()).unwrap_or(0)
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ratio_of_ten_to_the_eighth_is_refused_under_every_algorithm() {
    for algorithm in [
        "round-robin",
        "random",
        "least-request",
        "weighted-round-robin",
        "weighted-least-request",
        "weighted-least-request-p2c",
        "prefix-affinity",
    ] {
        let mut p = ProxyProcess::start(algorithm).await;
        let members: Vec<String> = p._fleet.addrs().iter().map(|a| a.to_string()).collect();
        let (status, text) = p
            .post_ratios(&json!({"pool": "llm", "ratios": {&members[0]: 100_000_000u32, &members[1]: 1}}))
            .await;
        assert_eq!(status, 400, "{algorithm}: {text}");
        assert!(text.contains("65535"), "{algorithm}: says the bound: {text}");
        // The largest accepted ratio builds a bounded ring and the proxy keeps serving.
        let (status, text) =
            p.post_ratios(&json!({"pool": "llm", "ratios": {&members[0]: 65_535u32, &members[1]: 1}})).await;
        assert_eq!(status, 200, "{algorithm}: {text}");
        assert!(p.completes().await, "{algorithm}: a request after the ratios");
        assert!(p.alive(), "{algorithm}: the proxy survived");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_megabyte_unknown_member_names_cost_the_log_a_few_lines() {
    let p = ProxyProcess::start("weighted-least-request").await;
    let before = p.log_bytes();
    let huge = "x".repeat(1 << 20);
    for i in 0..20 {
        let (status, text) =
            p.post_ratios(&json!({"pool": "llm", "ratios": {format!("{huge}{i}:80"): 5}})).await;
        assert_eq!(status, 200, "{text}");
        assert!(text.len() < 4096, "the answer echoes the name shortened, not {} bytes", text.len());
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["unknown_count"], 1);
    }
    // Before: 20 MB of log. The warning is rate-limited and the names shortened.
    let written = p.log_bytes() - before;
    assert!(written < 4096, "{written} bytes of log for twenty 1 MB names");
    let metrics = reqwest::get(format!("http://127.0.0.1:{}/metrics", p.api)).await.expect("metrics");
    let text = metrics.text().await.unwrap_or_default();
    assert!(text.contains("llmlc_proxy_unknown_ratio_members_total{pool=\"llm\"} 20"), "counted:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ratios_naming_a_member_twice_are_refused_by_the_admin_api() {
    let p = ProxyProcess::start("weighted-least-request").await;
    let m = p._fleet.addrs()[0].to_string();
    let body = format!(r#"{{"pool": "llm", "ratios": {{"{m}": 1, "{m}": 90}}}}"#);
    let resp = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/admin/ratios", p.admin))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("answers");
    assert_eq!(resp.status().as_u16(), 400);
    let text = resp.text().await.unwrap_or_default();
    assert!(text.contains("appears twice"), "{text}");
}

/// A llama.cpp member (page and `/props`) that takes `delay` to answer each.
async fn llamacpp_member(page_delay: Duration, props_delay: Duration) -> llm_lc_testkit::envoy::Served {
    use axum::routing::get;
    let page: &'static str = include_str!("llamacpp/fixtures/metrics-busy.txt");
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || async move {
                tokio::time::sleep(page_delay).await;
                page
            }),
        )
        .route(
            "/props",
            get(move || async move {
                tokio::time::sleep(props_delay).await;
                axum::Json(json!({"total_slots": 4}))
            }),
        );
    llm_lc_testkit::envoy::serve(app).await
}

/// Watch `/v1/ratios` for `cycles` new cycles; per cycle, the members that had a sample.
async fn sampled_members_per_cycle(run: &Running, cycles: usize, within: Duration) -> Vec<Vec<String>> {
    let mut seen_ts = String::new();
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    while out.len() < cycles && tokio::time::Instant::now() < deadline {
        let v: Option<serde_json::Value> = async {
            reqwest::get(format!("http://127.0.0.1:{}/v1/ratios", run.listen())).await.ok()?.json().await.ok()
        }
        .await;
        if let Some(v) = v {
            let ts = v["ts"].as_str().unwrap_or_default().to_string();
            if !ts.is_empty() && ts != seen_ts {
                seen_ts = ts;
                let members = v["pools"][0]["members"].as_array().cloned().unwrap_or_default();
                out.push(
                    members
                        .iter()
                        .filter(|m| !m["waiting"].is_null())
                        .filter_map(|m| m["member"].as_str().map(str::to_string))
                        .collect(),
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    out
}

async fn slow_member_case(interval: &str, page_delay: Duration, props_delay: Duration, cycles: usize) {
    let mut fast = Vec::new();
    for _ in 0..4 {
        fast.push(llamacpp_member(Duration::ZERO, Duration::ZERO).await);
    }
    let slow = llamacpp_member(page_delay, props_delay).await;
    let list: Vec<String> = fast.iter().chain([&slow]).map(|s| format!("'{}'", s.addr())).collect();
    let body = format!(
        "sources:\n  direct: {{ kind: scrape, timeout: 2s }}\npools:\n  - name: llm\n    source: direct\n    \
         profile: llamacpp\n    members: {{ static: [{}] }}\n    sink: {{ kind: dry-run }}\n",
        list.join(", ")
    );
    let run = Running::start(std::path::Path::new(BIN), interval, &body);
    let per_cycle = sampled_members_per_cycle(&run, cycles + 1, Duration::from_secs(120)).await;
    let fast_addrs: Vec<String> = fast.iter().map(|s| s.addr()).collect();
    // The first cycle may predate every answer; every later one has the four fast members.
    let with_all_fast =
        per_cycle.iter().skip(1).filter(|got| fast_addrs.iter().all(|f| got.contains(f))).count();
    assert_eq!(
        with_all_fast,
        per_cycle.len() - 1,
        "cycles with the four fast members' samples: {per_cycle:?}\nlog:\n{}",
        run.log()
    );
    assert!(per_cycle.len() > cycles, "saw {} cycles", per_cycle.len());
    let log = run.log();
    assert!(log.contains(&slow.addr()) && log.contains("budget"), "the slow member is named:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_answering_in_1_8_s_beside_four_fast_ones_costs_only_itself() {
    // Page and /props each 1.8 s at a 3 s interval: before, 20 of 20 cycles had no sample at all.
    slow_member_case("3s", Duration::from_millis(1800), Duration::from_millis(1800), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_props_read_at_a_short_interval_costs_only_its_slot_count() {
    // /props in 1.5 s at a 1 s interval: before, 90 of 90 cycles failed.
    slow_member_case("1s", Duration::ZERO, Duration::from_millis(1500), 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_cautions_when_the_interval_is_shorter_than_one_members_reads() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        "interval: 3s\nsources:\n  direct: { kind: scrape, timeout: 2s }\npools:\n  - name: llm\n    \
         source: direct\n    profile: llamacpp\n    members: { static: ['10.0.0.1:8080'] }\n    sink: { kind: dry-run }\n",
    )
    .expect("config");
    let out = std::process::Command::new(BIN)
        .args(["check", "--offline", "--config"])
        .arg(&cfg)
        .output()
        .expect("check");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("# caution: sources.direct.timeout:") && text.contains("4s"), "{text}");
    // At the default interval (5 s) two 2 s reads fit: no caution.
    std::fs::write(
        &cfg,
        std::fs::read_to_string(&cfg).expect("read").replace("interval: 3s", "interval: 5s"),
    )
    .expect("config");
    let out = std::process::Command::new(BIN)
        .args(["check", "--offline", "--config"])
        .arg(&cfg)
        .output()
        .expect("check");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("caution"));
}

/// A Prometheus HTTP API double whose `up` targets churn (ten new member addresses every 2 s) and
/// whose metric queries are answered 1.5 s late in every third second, as a loaded Thanos querier.
async fn churning_prometheus(started: std::time::Instant) -> llm_lc_testkit::envoy::Served {
    use axum::extract::Query;
    use axum::routing::get;
    use std::collections::HashMap;
    let app = axum::Router::new().route(
        "/api/v1/query",
        get(move |Query(q): Query<HashMap<String, String>>| async move {
            let elapsed = started.elapsed();
            let generation = elapsed.as_secs() / 2;
            let query = q.get("query").cloned().unwrap_or_default();
            if !query.starts_with("up") && elapsed.as_secs() % 3 == 0 {
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or_default();
            // Fresh samples: the age query (`timestamp(...)`) is answered with now.
            let value = if query.contains("timestamp(") { format!("{now}") } else { "1".to_string() };
            let result: Vec<serde_json::Value> = (0..10)
                .map(|i| {
                    json!({"metric": {"instance": format!("10.{}.{}.{i}:8000", generation / 250, generation % 250)},
                           "value": [now, value]})
                })
                .collect();
            axum::Json(json!({"status": "success", "data": {"resultType": "vector", "result": result}}))
        }),
    );
    llm_lc_testkit::envoy::serve(app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_that_churn_while_metric_queries_miss_the_deadline_leave_no_series() {
    let prom = churning_prometheus(std::time::Instant::now()).await;
    let body = format!(
        "sources:\n  prom: {{ kind: prometheus, url: '{}' }}\npools:\n  - name: llm\n    source: prom\n    \
         members: {{ prometheus_up: '{{job=\"vllm\"}}' }}\n    sink: {{ kind: dry-run }}\n",
        prom.url()
    );
    let run = Running::start(std::path::Path::new(BIN), "1s", &body);
    // Twelve seconds: six generations of members, four seconds of late answers.
    let _ = sampled_members_per_cycle(&run, 12, Duration::from_secs(40)).await;
    let metrics = run.metrics().await;
    for family in [
        "llmlc_member_weight",
        "llmlc_member_ratio",
        "llmlc_member_waiting_requests",
        "llmlc_member_sample_age_seconds",
    ] {
        let members: std::collections::BTreeSet<&str> = metrics
            .lines()
            .filter(|l| l.starts_with(&format!("{family}{{")))
            .filter_map(|l| l.split("member=\"").nth(1)?.split('"').next())
            .collect();
        assert!(
            members.len() <= 10,
            "{family}: {} members with series (10 live): {members:?}",
            members.len()
        );
    }
    assert!(metrics.contains("llmlc_member_weight{"), "the family is there at all:\n{metrics}");
}

/// A Prometheus HTTP API double with three steady `up` targets and instant answers.
async fn steady_prometheus() -> llm_lc_testkit::envoy::Served {
    use axum::routing::get;
    let app = axum::Router::new().route(
        "/api/v1/query",
        get(|| async {
            let result: Vec<serde_json::Value> = (1..=3)
                .map(|i| json!({"metric": {"instance": format!("10.0.0.{i}:8000")}, "value": [1.0, "1"]}))
                .collect();
            axum::Json(json!({"status": "success", "data": {"resultType": "vector", "result": result}}))
        }),
    );
    llm_lc_testkit::envoy::serve(app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_does_not_greet_every_discovered_member_again() {
    let prom = steady_prometheus().await;
    let body = format!(
        "sources:\n  prom: {{ kind: prometheus, url: '{}' }}\npools:\n  - name: llm\n    source: prom\n    \
         members: {{ prometheus_up: '{{job=\"vllm\"}}' }}\n    sink: {{ kind: dry-run }}\n",
        prom.url()
    );
    let run = Running::start(std::path::Path::new(BIN), "300ms", &body);
    let joined = |log: &str| log.lines().filter(|l| l.contains("member joined the pool")).count();
    wait::until(Duration::from_secs(20), "three members to join", || async {
        (joined(&run.log()) == 3).then_some(())
    })
    .await;
    let path = run.config_path();
    let text = std::fs::read_to_string(&path).expect("config");
    std::fs::write(&path, text.replace("sink: { kind: dry-run }", "grace: 20s\n    sink: { kind: dry-run }"))
        .expect("rewrite");
    wait::until(Duration::from_secs(20), "the reload", || async {
        run.log().contains("config reloaded").then_some(())
    })
    .await;
    // A few cycles after the reload: nobody joined again.
    let _ = sampled_members_per_cycle(&run, 4, Duration::from_secs(20)).await;
    assert_eq!(joined(&run.log()), 3, "{}", run.log());
}
