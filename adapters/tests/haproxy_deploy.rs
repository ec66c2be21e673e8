//! The shipped deploy/haproxy/*.cfg files, run for real with only addresses, ports, socket paths and
//! check intervals rewritten, driven by the sink configured as config/haproxy.yaml configures it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use llm_lc_adapters::haproxy::{HaproxyConfig, HaproxySink};
use llm_lc_adapters::{MemberId, RatioSink, Ratios};
use llm_lc_testkit::haproxy::Haproxy;
use llm_lc_testkit::wait;

const SHIPPED: [&str; 3] = ["10.0.0.11:8000", "10.0.0.12:8000", "10.0.0.13:8000"];

fn shipped(name: &str) -> String {
    let path = format!("{}/../deploy/haproxy/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// A model-server stand-in: `/health` answers 200; every other path is counted and answered after
/// `delay` (so concurrent requests overlap and leastconn has connections to compare).
async fn replica(delay: Duration) -> (String, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    let app =
        axum::Router::new().route("/health", axum::routing::get(|| async { "ok" })).fallback(move || {
            let counter = counter.clone();
            async move {
                tokio::time::sleep(delay).await;
                counter.fetch_add(1, Ordering::SeqCst);
                "done"
            }
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, hits)
}

/// Point the shipped file at the test's replicas, ports and sockets; speed up checks.
fn localize(cfg: &str, replicas: &[String]) -> String {
    let mut cfg = cfg
        .replace("bind *:8080", "bind 127.0.0.1:{{PORT:fe}}")
        .replace("stats socket /var/run/haproxy/admin.sock", "stats socket {{ADMIN_SOCKET}}")
        .replace("stats socket ipv4@127.0.0.1:9999", "stats socket ipv4@127.0.0.1:{{ADMIN_PORT}}")
        .replace("stats socket /var/run/haproxy/user.sock mode 660 level user", "{{STATS_SOCKETS}}")
        .replace("check inter 2s", "check inter 100ms")
        .replace("agent-inter 2s", "agent-inter 200ms");
    for (shipped, local) in SHIPPED.iter().zip(replicas) {
        cfg = cfg.replace(shipped, local);
    }
    assert!(!cfg.contains("10.0.0.1"), "a shipped address was not rewritten:\n{cfg}");
    cfg
}

async fn all_up(hx: &Haproxy, backend: &str) {
    wait::until(Duration::from_secs(5), &format!("servers of {backend} UP by health check"), || async {
        let mut up = true;
        for s in ["vllm-0", "vllm-1", "vllm-2"] {
            up &= hx.stat(backend, s, "status").await == "UP";
        }
        up.then_some(())
    })
    .await
}

/// Send `n` requests through the frontend, `concurrency` at a time.
async fn load(port: u16, n: usize, concurrency: usize) {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, next) = (client.clone(), next.clone());
            tokio::spawn(async move {
                while next.fetch_add(1, Ordering::SeqCst) < n {
                    let r =
                        client.post(format!("http://127.0.0.1:{port}/v1/completions")).send().await.unwrap();
                    assert!(r.status().is_success(), "HAProxy answered {}", r.status());
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
}

fn counts(hits: &[Arc<AtomicUsize>]) -> Vec<usize> {
    hits.iter().map(|h| h.swap(0, Ordering::SeqCst)).collect()
}

fn ratios(members: &[String], values: &[u32]) -> Ratios {
    members.iter().zip(values).map(|(m, v)| (MemberId::new(m), *v)).collect()
}

#[tokio::test]
async fn shipped_runtime_api_config_leastconn_and_roundrobin_follow_weights() {
    let mut members = Vec::new();
    let mut hits = Vec::new();
    for _ in 0..3 {
        let (addr, h) = replica(Duration::from_millis(40)).await;
        members.push(addr);
        hits.push(h);
    }
    let extra = "\nfrontend rr\n    bind 127.0.0.1:{{PORT:rr}}\n    default_backend llm_roundrobin\n";
    let hx = Haproxy::start(&(localize(&shipped("haproxy.cfg"), &members) + extra)).await;
    all_up(&hx, "llm").await;
    all_up(&hx, "llm_roundrobin").await;

    // config/haproxy.yaml's sink: membership from the backend, default mapping.
    let sink = HaproxySink::new(&HaproxyConfig::runtime(hx.runtime_address(), "llm"), "llm").unwrap();
    let mut want = members.iter().map(MemberId::new).collect::<Vec<_>>();
    want.sort();
    assert_eq!(sink.members().await.unwrap(), Some(want));

    // leastconn (the default backend) picks the lowest (connections + 1) / weight, so with 12 requests
    // in flight and weights 60:20:20 they settle at 8:2:2 (measured: 200:50:50 of 300): the heavy
    // server's share is above its weight's 60% at low concurrency, far above the 33% of equal weights.
    sink.apply(&ratios(&members, &[60, 20, 20])).await.unwrap();
    assert_eq!(hx.state_weights("llm").await.into_values().collect::<Vec<_>>(), vec![60, 20, 20]);
    load(hx.port("fe"), 300, 12).await;
    let c = counts(&hits);
    eprintln!("leastconn, weights 60:20:20, 12 in flight -> {c:?}");
    assert_eq!(c.iter().sum::<usize>(), 300);
    let share0 = c[0] as f64 / 300.0;
    assert!((0.55..=0.75).contains(&share0), "server 0 should take 60-70%, took {c:?}");

    // roundrobin variant (reached through a frontend the test adds): exact proportions.
    let rr =
        HaproxySink::new(&HaproxyConfig::runtime(hx.runtime_tcp_address(), "llm_roundrobin"), "rr").unwrap();
    rr.apply(&ratios(&members, &[10, 30, 60])).await.unwrap();
    assert_eq!(hx.state_weights("llm_roundrobin").await.into_values().collect::<Vec<_>>(), vec![10, 30, 60]);
    load(hx.port("rr"), 200, 10).await;
    let c = counts(&hits);
    eprintln!("roundrobin, weights 10:30:60 -> {c:?}");
    assert_eq!(c.iter().sum::<usize>(), 200);
    for (got, want) in c.iter().zip([20.0, 60.0, 120.0]) {
        assert!((*got as f64 - want).abs() <= want * 0.1 + 2.0, "roundrobin split {c:?}, want ~20/60/120");
    }
}

#[tokio::test]
async fn shipped_agent_config_takes_weights_from_the_controller() {
    let mut members = Vec::new();
    for _ in 0..3 {
        members.push(replica(Duration::ZERO).await.0);
    }
    let agent_port = llm_lc_testkit::ports::free_port();
    let cfg = shipped("haproxy-agent.cfg").replace(
        "agent-addr 10.0.0.5 agent-port 5555",
        &format!("agent-addr 127.0.0.1 agent-port {agent_port}"),
    );
    let hx = Haproxy::start(&localize(&cfg, &members)).await;
    all_up(&hx, "llm").await;

    // config/haproxy.yaml's commented agent pool, plus the optional read-only socket.
    let sink_cfg = HaproxyConfig {
        address: Some(hx.user_runtime_address()),
        ..HaproxyConfig::agent(format!("127.0.0.1:{agent_port}"), "llm")
    };
    let sink = HaproxySink::new(&sink_cfg, "llm-agent").unwrap();
    assert_eq!(sink.members().await.unwrap().map(|m| m.len()), Some(3));
    sink.apply(&ratios(&members, &[70, 20, 10])).await.unwrap();
    wait::until(Duration::from_secs(5), "agent weights 70/20/10 in HAProxy", || async {
        (hx.state_weights("llm").await.into_values().collect::<Vec<_>>() == vec![70, 20, 10]).then_some(())
    })
    .await;

    // Controller gone: the agent check fails, the servers stay UP on their health checks, and the
    // last weights stay.
    sink.shutdown().await;
    wait::until(Duration::from_secs(5), "HAProxy to notice the agent is gone", || async {
        let s = hx.stat("llm", "vllm-0", "agent_status").await;
        s.starts_with("L4").then_some(())
    })
    .await;
    for (s, w) in [("vllm-0", 70), ("vllm-1", 20), ("vllm-2", 10)] {
        assert_eq!(hx.stat("llm", s, "status").await, "UP", "{s} went down with the agent");
        assert_eq!(hx.weight("llm", s).await.0, w);
    }
}
