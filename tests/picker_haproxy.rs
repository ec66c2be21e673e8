//! The controller's endpoint picker behind a real HAProxy 2.6 over SPOE, with the shipped
//! `deploy/haproxy/haproxy-spoe.cfg` and `spoe-picker.conf` (issue 42): simulated vLLM servers on
//! loopback, the controller pushing weights over the runtime API and serving the agent, HAProxy
//! asking it per request. A prompt's requests stay on the server that has it and spill when it
//! saturates; with the agent unreachable, requests are still answered by HAProxy's own leastconn
//! over the pushed weights, without waiting out more than `timeout processing`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use llm_lc_sim::{Fleet, ModelProfile};
use llm_lc_testkit::controller::Running;
use llm_lc_testkit::haproxy::{start_shipped_spoe, Haproxy};
use llm_lc_testkit::{ports, sim, wait};
use serde_json::json;

fn bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_llm-load-controller"))
}

async fn haproxy(fleet: &Fleet, agent_port: u16, spoe_dir: &std::path::Path) -> Haproxy {
    let members: Vec<String> = fleet.addrs().iter().map(|a| a.to_string()).collect();
    start_shipped_spoe(&members, agent_port, spoe_dir, "llm").await
}

fn controller(fleet: &Fleet, hx: &Haproxy, agent_port: u16) -> Running {
    controller_with(fleet, hx, agent_port, "")
}

/// `settings`: the picker's, as flow-mapping entries (`saturation_tokens: 50`).
fn controller_with(fleet: &Fleet, hx: &Haproxy, agent_port: u16, settings: &str) -> Running {
    let members: Vec<String> = fleet.addrs().iter().map(|a| format!("'{a}'")).collect();
    Running::start(
        bin(),
        "1s",
        &format!(
            "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ static: [{}] }}\n    sink: {{ kind: haproxy, address: '{}', backend: llm }}\n    picker: {{ spoe: '127.0.0.1:{agent_port}', refresh: 50ms, settings: {{ {settings} }} }}\n",
            members.join(", "),
            hx.runtime_tcp_address()
        ),
    )
}

fn ask(doc: &str, question: &str, max_tokens: u32) -> String {
    json!({"model": "sim-tiny", "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": doc}, {"role": "user", "content": question}]})
    .to_string()
}

fn document(n: usize) -> String {
    format!("document {n}: ") + &"the same long context, sent again and again. ".repeat(25)
}

/// POST through HAProxy: status, the server that answered, how long it took.
async fn send(hx: &Haproxy, body: String) -> (u16, String, Duration) {
    send_with(hx, body, &[]).await
}

async fn send_with(hx: &Haproxy, body: String, headers: &[(&str, &str)]) -> (u16, String, Duration) {
    let t0 = Instant::now();
    let resp = sim::client()
        .post(format!("http://127.0.0.1:{}/v1/chat/completions", hx.port("fe")))
        .header("content-type", "application/json")
        .headers(
            headers
                .iter()
                .map(|(k, v)| {
                    (
                        reqwest::header::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                        reqwest::header::HeaderValue::from_str(v).expect("value"),
                    )
                })
                .collect(),
        )
        .body(body)
        .send()
        .await
        .expect("HAProxy answers");
    let status = resp.status().as_u16();
    let server = resp.headers().get("x-upstream").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let _ = resp.bytes().await;
    (status, server, t0.elapsed())
}

async fn picks(c: &Running) -> f64 {
    c.metrics()
        .await
        .lines()
        .filter(|l| {
            l.starts_with("llmlc_picker_picks") && l.contains("door=\"spoe\"") && l.contains("picked")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_stays_on_its_server_and_spills_when_that_server_saturates() {
    let fleet = sim::fleet(ModelProfile::tiny(), &[1.0, 1.0, 1.0], |_| {}).await;
    let agent_port = ports::free_port();
    let dir = tempfile::tempdir().expect("tmp");
    let hx = haproxy(&fleet, agent_port, dir.path()).await;
    let c = controller(&fleet, &hx, agent_port);
    // The agent answers once the controller has members and the backend's server names.
    wait::until_or(
        Duration::from_secs(20),
        "the agent placing a prompt by name",
        || async {
            let before = picks(&c).await;
            let (status, _, _) = send(&hx, ask(&document(99), "warm up", 2)).await;
            (status == 200 && picks(&c).await > before).then_some(())
        },
        || format!("controller:\n{}\nhaproxy:\n{}", c.log(), hx.log()),
    )
    .await;
    let doc = document(0);
    let (_, home, _) = send(&hx, ask(&doc, "first", 2)).await;
    for q in 0..6 {
        let (status, at, _) = send(&hx, ask(&doc, &format!("question {q}"), 2)).await;
        assert_eq!((status, at.as_str()), (200, home.as_str()), "the prompt stays where it is cached");
    }
    let mut homes = BTreeSet::new();
    for n in 1..13 {
        homes.insert(send(&hx, ask(&document(n), "q", 2)).await.1);
    }
    assert!(homes.len() >= 2, "twelve prompts all on one server: {homes:?}");
    let burst = (0..24).map(|i| send(&hx, ask(&doc, &format!("burst {i}"), 200)));
    let mut by_server: BTreeMap<String, usize> = BTreeMap::new();
    for (status, at, _) in futures::future::join_all(burst).await {
        assert_eq!(status, 200);
        *by_server.entry(at).or_default() += 1;
    }
    assert!(by_server.len() >= 2, "a saturated server spills: {by_server:?}");
    let at_home = by_server.get(&home).copied().unwrap_or(0);
    assert!(by_server.values().all(|n| *n <= at_home), "home keeps the largest share: {by_server:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_agent_unreachable_haproxy_balances_by_itself_without_waiting() {
    let fleet = sim::fleet(ModelProfile::tiny(), &[1.0, 1.0, 1.0], |_| {}).await;
    let gone = ports::refused();
    let dir = tempfile::tempdir().expect("tmp");
    let hx = haproxy(&fleet, gone.addr.port(), dir.path()).await;
    let mut servers = BTreeSet::new();
    let mut slowest = Duration::ZERO;
    for n in 0..30 {
        let (status, at, took) = send(&hx, ask(&document(n % 3), "q", 2)).await;
        assert_eq!(status, 200, "fail-open: HAProxy's own balancing answers");
        servers.insert(at);
        slowest = slowest.max(took);
    }
    assert!(servers.len() >= 2, "leastconn spreads: {servers:?}");
    // `timeout processing` is 50 ms: nothing waits much longer for an agent that is not there.
    assert!(slowest < Duration::from_millis(1000), "slowest request {slowest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_static_rules_command_prints_a_valid_rule_per_server() {
    let fleet = sim::fleet(ModelProfile::tiny(), &[1.0, 1.0, 1.0], |_| {}).await;
    let dir = tempfile::tempdir().expect("tmp");
    let hx = haproxy(&fleet, ports::free_port(), dir.path()).await;
    let out = std::process::Command::new(bin())
        .args(["picker", "haproxy-rules", "--runtime", &hx.runtime_tcp_address(), "--backend", "llm"])
        .output()
        .expect("run the command");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rules = String::from_utf8_lossy(&out.stdout).to_string();
    for s in ["vllm-0", "vllm-1", "vllm-2"] {
        assert!(rules.contains(&format!("use-server {s} if {{ var(txn.llmlc.srv) -m str {s} }}")), "{rules}");
    }
    // The rules in place of the shipped dynamic one: HAProxy accepts the config.
    let cfg = hx
        .config()
        .replace("    use-server %[var(txn.llmlc.srv)] if { var(txn.llmlc.srv) -m found }\n", &rules);
    assert_ne!(cfg, hx.config(), "the shipped rule was replaced");
    let path = dir.path().join("static-rules.cfg");
    std::fs::write(&path, cfg).expect("write");
    let check = std::process::Command::new(llm_lc_testkit::haproxy::binary())
        .arg("-c")
        .arg("-f")
        .arg(&path)
        .output()
        .expect("haproxy -c");
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    // A backend that is not there is an error, not an empty list.
    let bad = std::process::Command::new(bin())
        .args(["picker", "haproxy-rules", "--runtime", &hx.runtime_tcp_address(), "--backend", "nope"])
        .output()
        .expect("run the command");
    assert_eq!(bad.status.code(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sheddable_request_is_refused_with_429_while_every_server_is_saturated() {
    let fleet = sim::fleet(ModelProfile::tiny(), &[1.0, 1.0, 1.0], |_| {}).await;
    let agent_port = ports::free_port();
    let dir = tempfile::tempdir().expect("tmp");
    let hx = haproxy(&fleet, agent_port, dir.path()).await;
    // Saturated here means more than 50 prompt tokens waiting per server.
    let c = controller_with(&fleet, &hx, agent_port, "saturation_tokens: 50");
    wait::until_or(
        Duration::from_secs(20),
        "the agent placing requests",
        || async {
            let before = picks(&c).await;
            let (status, _, _) = send(&hx, ask(&document(98), "warm up", 2)).await;
            (status == 200 && picks(&c).await > before).then_some(())
        },
        || c.log(),
    )
    .await;
    let sheddable = [("x-criticality", "sheddable")];
    assert_eq!(
        send_with(&hx, ask(&document(0), "idle", 2), &sheddable).await.0,
        200,
        "an idle pool takes it"
    );
    let flood = futures::future::join_all((0..40).map(|i| send(&hx, ask(&document(100 + i), "long", 300))));
    let probe = async {
        wait::until_or(
            Duration::from_secs(10),
            "a sheddable request refused",
            || async {
                (send_with(&hx, ask(&document(7), "may I", 2), &sheddable).await.0 == 429).then_some(())
            },
            || c.log(),
        )
        .await;
        send(&hx, ask(&document(8), "standard", 2)).await.0
    };
    // While the flood runs, the picker shows requests in flight (its SPOE picks are tracked once
    // HAProxy has reported a `done`).
    let in_flight = async {
        wait::until(Duration::from_secs(10), "requests in flight shown", || async {
            let page = c.metrics().await;
            let total: f64 = page
                .lines()
                .filter(|l| l.starts_with("llmlc_picker_in_flight{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            (total > 0.0).then_some(())
        })
        .await
    };
    let (done, standard, ()) = tokio::join!(flood, probe, in_flight);
    assert_eq!(standard, 200, "only sheddable requests are refused");
    assert!(done.iter().all(|(status, _, _)| *status == 200), "the long requests all answered");
}
