//! The controller's endpoint picker behind a real Envoy (1.40) over ext_proc, the Gateway API
//! Inference Extension's endpoint-picker protocol, with the shipped `deploy/envoy/envoy-epp.yaml`
//! (issue 42): simulated vLLM servers on loopback, the controller feeding Envoy's EDS and serving
//! the picker, Envoy asking it per request.
//!
//! What is checked, as the extension's conformance suite asks of an EPP (locally, without a
//! cluster): a prompt's requests reach the server that has it, and spread when it saturates;
//! traffic reaches only the endpoints a subset hint lists (one, two, all); the endpoint used is
//! reported back; a client's own destination header steers nothing; with the picker unreachable,
//! requests still answer 200, weighted by the controller's EDS (fail-open).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use llm_lc_sim::{Fleet, ModelProfile};
use llm_lc_testkit::controller::Running;
use llm_lc_testkit::envoy::Envoy;
use llm_lc_testkit::{ports, sim, wait};
use serde_json::json;

fn bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_llm-load-controller"))
}

/// The response header the test bootstrap adds: where Envoy sent the request.
const UPSTREAM: &str = "x-upstream";

struct Setup {
    fleet: Fleet,
    controller: Running,
    epp_port: u16,
}

impl Setup {
    async fn start() -> Setup {
        Setup::start_with(ModelProfile::tiny(), "").await
    }

    /// The ext_proc door over TLS (`tls` as flow-mapping entries of `picker.tls`).
    async fn start_tls(tls: &str) -> Setup {
        Setup::start_configured(ModelProfile::tiny(), "", &format!(", tls: {{ {tls} }}")).await
    }

    /// `settings`: the picker's, as flow-mapping entries (`saturation_tokens: 50`).
    async fn start_with(profile: ModelProfile, settings: &str) -> Setup {
        Setup::start_configured(profile, settings, "").await
    }

    /// `more`: further entries of the `picker` mapping, each after a comma.
    async fn start_configured(profile: ModelProfile, settings: &str, more: &str) -> Setup {
        let fleet = sim::fleet(profile, &[1.0, 1.0, 1.0], |_| {}).await;
        let members: Vec<String> = fleet.addrs().iter().map(|a| format!("'{a}'")).collect();
        let (epp_port, health_port) = (ports::free_port(), ports::free_port());
        let body = format!(
            "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ static: [{}] }}\n    sink: {{ kind: envoy, cluster: vllm }}\n    picker: {{ ext_proc: '127.0.0.1:{epp_port}', health: '127.0.0.1:{health_port}', refresh: 50ms, settings: {{ {settings} }}{more} }}\n",
            members.join(", ")
        );
        let controller = Running::start(bin(), "1s", &body);
        Setup { fleet, controller, epp_port }
    }

    /// Until Envoy's gRPC health check of the picker has succeeded.
    async fn wait_healthy(&self, envoy: &Envoy) {
        wait::until_or(
            Duration::from_secs(15),
            "the picker healthy in Envoy",
            || async {
                envoy
                    .stat("cluster.llm-load-controller-epp.health_check.success")
                    .await
                    .filter(|n| *n > 0)
                    .map(|_| ())
            },
            || format!("controller:\n{}\nenvoy:\n{}", self.controller.log(), envoy.log()),
        )
        .await;
    }

    /// The shipped bootstrap on free ports, asking the picker at `epp_port`, with `extra`
    /// replacements (a filter before ext_proc, say); returns once Envoy has every server.
    async fn envoy(&self, epp_port: u16, extra: &[(&str, &str)]) -> Envoy {
        let envoy = Envoy::start_shipped_epp(self.controller.listen(), epp_port, extra).await;
        let want = self.fleet.len();
        wait::until_or(
            Duration::from_secs(20),
            "Envoy has every server from the controller's EDS",
            || async { envoy.weights("vllm").await.filter(|w| w.len() == want).map(|_| ()) },
            || format!("controller:\n{}\nenvoy:\n{}", self.controller.log(), envoy.log()),
        )
        .await;
        envoy
    }
}

/// A chat request with a long shared system prompt `doc`.
fn ask(doc: &str, question: &str, max_tokens: u32) -> String {
    json!({"model": "sim-tiny", "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": doc}, {"role": "user", "content": question}]})
    .to_string()
}

fn document(n: usize) -> String {
    format!("document {n}: ") + &"the same long context, sent again and again. ".repeat(25)
}

/// POST through Envoy; status and the upstream that answered.
async fn send(envoy: &Envoy, body: String, headers: &[(&str, &str)]) -> (u16, String) {
    let port = envoy.listener_port("inference").await.expect("listener bound");
    let mut req = sim::client()
        .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.expect("Envoy answers");
    let status = resp.status().as_u16();
    let upstream = resp.headers().get(UPSTREAM).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let _ = resp.bytes().await;
    (status, upstream)
}

/// The controller's `llmlc_picker_*` series with `needle` in their line, summed.
async fn picker_metric(controller: &Running, needle: &str) -> f64 {
    controller
        .metrics()
        .await
        .lines()
        .filter(|l| l.starts_with("llmlc_picker_") && l.contains(needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_stays_home_spreads_when_home_saturates_and_a_client_header_steers_nothing() {
    let s = Setup::start().await;
    let envoy = s.envoy(s.epp_port, &[]).await;
    // Envoy health-checks the picker over gRPC health before it sends it anything.
    s.wait_healthy(&envoy).await;
    let doc = document(0);
    let (status, home) = send(&envoy, ask(&doc, "first question", 2), &[]).await;
    assert_eq!(status, 200);
    assert!(s.fleet.addrs().iter().any(|a| a.to_string() == home), "{home} is a server");
    for q in 0..6 {
        let (status, at) = send(&envoy, ask(&doc, &format!("question {q}"), 2), &[]).await;
        assert_eq!((status, at.as_str()), (200, home.as_str()), "the prompt stays where it is cached");
    }
    // A client's own destination header is overwritten: the prompt still goes home.
    let other = s.fleet.addrs().iter().map(|a| a.to_string()).find(|a| *a != home).expect("another server");
    let (status, at) =
        send(&envoy, ask(&doc, "steer me", 2), &[("x-gateway-destination-endpoint", other.as_str())]).await;
    assert_eq!((status, at.as_str()), (200, home.as_str()));
    // Other prompts have other homes.
    let mut homes = BTreeSet::new();
    for n in 1..13 {
        homes.insert(send(&envoy, ask(&document(n), "q", 2), &[]).await.1);
    }
    assert!(homes.len() >= 2, "twelve prompts all on one server: {homes:?}");
    // Many long requests of the prompt at once: home takes its share, then they spread.
    let burst = (0..24).map(|i| send(&envoy, ask(&doc, &format!("burst {i}"), 200), &[]));
    let placed = futures::future::join_all(burst).await;
    let mut by_server: BTreeMap<String, usize> = BTreeMap::new();
    for (status, at) in &placed {
        assert_eq!(*status, 200);
        *by_server.entry(at.clone()).or_default() += 1;
    }
    assert!(by_server.len() >= 2, "a saturated home spills: {by_server:?}");
    let at_home = by_server.get(&home).copied().unwrap_or(0);
    assert!(by_server.values().all(|n| *n <= at_home), "home keeps the largest share: {by_server:?}");
    // The data plane reported each endpoint it used, and every pick was used as picked.
    wait::until(Duration::from_secs(5), "the served endpoints reported", || async {
        let reported = picker_metric(&s.controller, "as_picked=\"true\"").await;
        (reported >= 40.0).then_some(())
    })
    .await;
    assert_eq!(picker_metric(&s.controller, "as_picked=\"false\"").await, 0.0);
    // Every request ended: the picker shows nothing in flight on any of the three servers.
    wait::until(Duration::from_secs(5), "nothing in flight", || async {
        let page = s.controller.metrics().await;
        let series: Vec<&str> = page.lines().filter(|l| l.starts_with("llmlc_picker_in_flight{")).collect();
        (series.len() == 3 && series.iter().all(|l| l.ends_with(" 0.0") || l.ends_with(" 0"))).then_some(())
    })
    .await;
    assert!(picker_metric(&s.controller, "outcome=\"picked\"").await >= 44.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_reaches_only_the_endpoints_a_subset_hint_lists() {
    let s = Setup::start().await;
    let all: Vec<String> = s.fleet.addrs().iter().map(|a| a.to_string()).collect();
    // A filter before ext_proc sets the hint, as a gateway's own filter would.
    let hint = |subset: &[String]| {
        let list = subset.iter().map(|a| format!("\"{a}\"")).collect::<Vec<_>>().join(", ");
        format!(
            "          http_filters:\n          - name: envoy.filters.http.set_metadata\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n              metadata:\n              - metadata_namespace: envoy.lb.subset_hint\n                value: {{x-gateway-destination-endpoint-subset: [{list}]}}\n"
        )
    };
    for (case, subset) in
        [vec![all[1].clone()], vec![all[0].clone(), all[2].clone()], all.clone()].into_iter().enumerate()
    {
        let filter = hint(&subset);
        let envoy = s.envoy(s.epp_port, &[("          http_filters:\n", filter.as_str())]).await;
        let mut reached = BTreeSet::new();
        // Documents of this case only: the picker remembers where earlier cases sent theirs.
        for n in 100 * case..100 * case + 12 {
            let (status, at) = send(&envoy, ask(&document(n), "q", 2), &[]).await;
            assert_eq!(status, 200);
            reached.insert(at);
        }
        let allowed: BTreeSet<String> = subset.iter().cloned().collect();
        assert!(reached.is_subset(&allowed), "subset {allowed:?}, reached {reached:?}");
        if subset.len() > 1 {
            assert!(reached.len() > 1, "twelve prompts over {allowed:?} all went to {reached:?}");
        }
    }
    // A hint naming no server of the pool: 503 from the picker, not some other server.
    let filter = hint(&["10.255.0.1:8000".to_string()]);
    let envoy = s.envoy(s.epp_port, &[("          http_filters:\n", filter.as_str())]).await;
    assert_eq!(send(&envoy, ask(&document(0), "q", 2), &[]).await.0, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_picker_unreachable_requests_still_answer_by_the_weights() {
    let s = Setup::start().await;
    let gone = ports::refused();
    let envoy = s.envoy(gone.addr.port(), &[]).await;
    let all: BTreeSet<String> = s.fleet.addrs().iter().map(|a| a.to_string()).collect();
    let mut reached = BTreeSet::new();
    let target = all.iter().next().cloned().expect("a server");
    let mut on_target = 0;
    for n in 0..30 {
        // Every request also names a server itself: with nobody to overwrite it, it still steers nothing.
        let (status, at) = send(
            &envoy,
            ask(&document(n % 3), "q", 2),
            &[("x-gateway-destination-endpoint", target.as_str())],
        )
        .await;
        assert_eq!(status, 200, "fail-open: the weighted fallback answers\n{}", envoy.log());
        on_target += usize::from(at == target);
        reached.insert(at);
    }
    assert!(reached.is_subset(&all));
    assert!(reached.len() >= 2, "the fallback spreads: {reached:?}");
    assert!(on_target < 30, "a client's header does not pin the fallback");
    assert_eq!(picker_metric(&s.controller, "outcome=").await, 0.0, "the picker was never asked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_protocols_full_duplex_mode_carries_bodies_both_ways_and_keeps_a_prompt_home() {
    // Servers that take a prompt longer than two of the picker's 62,000-byte chunks.
    let mut profile = ModelProfile::tiny();
    profile.max_model_len = 65_536;
    profile.num_gpu_blocks = 8192;
    let s = Setup::start_with(profile, "").await;
    // The extension's reference processing mode: bodies streamed through the picker both ways.
    let duplex = "              processing_mode:\n                request_header_mode: SEND\n                response_header_mode: SEND\n                request_body_mode: FULL_DUPLEX_STREAMED\n                response_body_mode: FULL_DUPLEX_STREAMED\n                request_trailer_mode: SEND\n                response_trailer_mode: SEND\n";
    let shipped = "              processing_mode:\n                request_header_mode: SEND\n                response_header_mode: SEND\n                request_body_mode: BUFFERED\n                response_body_mode: NONE\n                request_trailer_mode: SKIP\n                response_trailer_mode: SKIP\n";
    let envoy = s.envoy(s.epp_port, &[(shipped, duplex)]).await;
    let port = envoy.listener_port("inference").await.expect("listener bound");
    // A prompt over two of the picker's 62,000-byte chunks, answered whole, then streamed.
    let doc = "a long document that is sent whole each time. ".repeat(2900);
    let mut home = None;
    for (i, stream) in [(0, false), (1, false), (2, true), (3, true)] {
        let body = json!({"model": "sim-tiny", "max_tokens": 4, "stream": stream, "messages": [
            {"role": "system", "content": doc}, {"role": "user", "content": format!("question {i}")}]});
        let resp = sim::client()
            .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .expect("Envoy answers");
        assert_eq!(resp.status().as_u16(), 200, "{}", envoy.log());
        let at = resp.headers().get(UPSTREAM).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        let text = resp.text().await.expect("the whole answer");
        if stream {
            assert!(text.trim_end().ends_with("data: [DONE]"), "the stream arrives to its end: {text}");
        } else {
            let v: serde_json::Value = serde_json::from_str(&text).expect("a whole JSON answer");
            // The server saw the whole prompt (its token count is the prompt's, not a chunk's).
            assert!(v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 25_000, "{v}");
        }
        assert_eq!(home.get_or_insert_with(|| at.clone()), &at, "the prompt stays home");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sheddable_request_is_refused_with_429_while_every_server_is_saturated() {
    // Saturated here means more than 50 prompt tokens waiting per server: a queue of long requests.
    let s = Setup::start_with(ModelProfile::tiny(), "saturation_tokens: 50").await;
    let envoy = s.envoy(s.epp_port, &[]).await;
    let sheddable = [("x-criticality", "sheddable")];
    let (status, _) = send(&envoy, ask(&document(0), "idle", 2), &sheddable).await;
    assert_eq!(status, 200, "an idle pool takes a sheddable request");
    // 40 long requests at once: 8 run on each server, the rest wait.
    let flood =
        futures::future::join_all((0..40).map(|i| send(&envoy, ask(&document(100 + i), "long", 300), &[])));
    let probe = async {
        wait::until_or(
            Duration::from_secs(10),
            "a sheddable request refused",
            || async {
                (send(&envoy, ask(&document(7), "may I", 2), &sheddable).await.0 == 429).then_some(())
            },
            || s.controller.log(),
        )
        .await;
        // Meanwhile a standard request is still placed.
        send(&envoy, ask(&document(8), "standard", 2), &[]).await.0
    };
    let (done, standard) = tokio::join!(flood, probe);
    assert_eq!(standard, 200, "only sheddable requests are refused");
    assert!(done.iter().all(|(status, _)| *status == 200), "the long requests all answered");
    assert!(picker_metric(&s.controller, "outcome=\"shed\"").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_serves_envoy_over_tls_from_pem_files() {
    let dir = tempfile::tempdir().expect("tmp");
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let made = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
        ])
        .args([
            "-subj",
            "/CN=llm-load-controller",
            "-addext",
            "subjectAltName=DNS:llm-load-controller,IP:127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl runs");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let tls = format!("cert_file: '{}', key_file: '{}'", cert.display(), key.display());
    let s = Setup::start_tls(&tls).await;
    let transport = format!(
        "    transport_socket:\n      name: envoy.transport_sockets.tls\n      typed_config:\n        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        sni: llm-load-controller\n        common_tls_context:\n          alpn_protocols: [h2]\n          validation_context: {{trusted_ca: {{filename: '{}'}}}}\n    health_checks:\n    - timeout: 1s\n",
        cert.display()
    );
    let envoy = s.envoy(s.epp_port, &[("    health_checks:\n    - timeout: 1s\n", transport.as_str())]).await;
    s.wait_healthy(&envoy).await;
    let doc = document(0);
    let (status, home) = send(&envoy, ask(&doc, "first", 2), &[]).await;
    assert_eq!(status, 200);
    for q in 0..4 {
        assert_eq!(send(&envoy, ask(&doc, &format!("q{q}"), 2), &[]).await, (200, home.clone()));
    }
    assert!(picker_metric(&s.controller, "outcome=\"picked\"").await >= 5.0, "the picker placed them");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_mid_answer_leaves_nothing_in_flight() {
    // Slow decoding: 1,500 tokens take 15 s, so only the hang-up can end the request soon.
    let mut profile = ModelProfile::tiny();
    profile.step_overhead_s = 0.01;
    let s = Setup::start_with(profile, "").await;
    let envoy = s.envoy(s.epp_port, &[]).await;
    let port = envoy.listener_port("inference").await.expect("listener bound");
    let in_flight = || async {
        s.controller
            .metrics()
            .await
            .lines()
            .filter(|l| l.starts_with("llmlc_picker_in_flight{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let body = json!({"model": "sim-tiny", "max_tokens": 1500, "stream": true, "messages": [
        {"role": "user", "content": document(0)}]});
    let mut resp = sim::client()
        .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("Envoy answers");
    assert_eq!(resp.status().as_u16(), 200);
    resp.chunk().await.expect("the first chunk").expect("a chunk");
    wait::until(Duration::from_secs(5), "the request shown in flight", || async {
        (in_flight().await == 1.0).then_some(())
    })
    .await;
    drop(resp);
    let hung_up = std::time::Instant::now();
    wait::until(Duration::from_secs(5), "the hang-up released", || async {
        (in_flight().await == 0.0).then_some(())
    })
    .await;
    assert!(hung_up.elapsed() < Duration::from_secs(5), "released by the hang-up, not by the answer's end");
}
