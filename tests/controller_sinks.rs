//! The controller binary driving each load balancer end to end: the full loop (membership from the
//! LB, sampling, policy, push, fail-static, backoff) against the strict BIG-IP double, a real HAProxy
//! and a real Envoy. Sink-level details are tested in the adapters crate; these tests check the
//! wiring and that the loop keeps going through failures.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use llm_lc_testkit::bigip::{
    BigIpDouble, DoubleConfig, Fault, FaultKind, MemberSpec, PoolSpec, Role, UserSpec,
};
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::{ports, wait};

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

/// The controller as a child process with its own temp dir, stopped with SIGTERM on drop.
struct Running {
    child: Child,
    listen: u16,
    dir: tempfile::TempDir,
}

impl Running {
    fn start(config_body: &str) -> Running {
        Running::start_every("300ms", config_body)
    }

    fn start_every(interval: &str, config_body: &str) -> Running {
        let dir = tempfile::tempdir().expect("tmp");
        let listen = ports::free_port();
        let cfg = dir.path().join("controller.yaml");
        std::fs::write(&cfg, format!("interval: {interval}\nlisten: 127.0.0.1:{listen}\n{config_body}"))
            .expect("config");
        let out = Command::new(BIN).args(["check", "--config"]).arg(&cfg).output().expect("check");
        assert!(out.status.success(), "config rejected: {}", String::from_utf8_lossy(&out.stderr));
        let child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr.log")).expect("log"))
            .spawn()
            .expect("start controller");
        Running { child, listen, dir }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    /// The ratios of the controller's last cycle for `pool`, from `GET /v1/ratios`.
    async fn ratios(&self, pool: &str) -> Option<BTreeMap<String, u64>> {
        let v: serde_json::Value = reqwest::get(format!("http://127.0.0.1:{}/v1/ratios", self.listen))
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let p = v["pools"].as_array()?.iter().find(|p| p["pool"] == pool)?;
        Some(
            p["members"]
                .as_array()?
                .iter()
                .filter_map(|m| Some((m["member"].as_str()?.to_string(), m["ratio"].as_u64()?)))
                .collect(),
        )
    }

    async fn metrics(&self) -> String {
        match reqwest::get(format!("http://127.0.0.1:{}/metrics", self.listen)).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// SIGTERM, then the exit status (within 5 s).
    async fn stop(mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let child = &mut self.child;
        wait::until(Duration::from_secs(5), "controller to exit", || {
            let s = child.try_wait().ok().flatten();
            async move { s }
        })
        .await
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Three metrics pages, from the strongest replica to the weakest.
async fn targets() -> Vec<MetricsTarget> {
    vec![
        // All three at their limit with a queue, the last one the slowest: it runs the fewest
        // requests, queues the most and fills its KV cache. Every policy ranks it lowest (load
        // policies by its load, the capacity policy by what it manages to run).
        MetricsTarget::vllm(1.0, 60.0, 0.50).await,
        MetricsTarget::vllm(5.0, 40.0, 0.70).await,
        MetricsTarget::vllm(12.0, 20.0, 0.95).await,
    ]
}

fn strictly_decreasing(r: &BTreeMap<String, u64>, order: &[String]) -> bool {
    order.windows(2).all(|w| matches!((r.get(&w[0]), r.get(&w[1])), (Some(a), Some(b)) if a > b))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_loop_rides_through_faults_and_ends_with_the_desired_ratios() {
    let t = targets().await;
    let order: Vec<String> = t.iter().map(|x| x.member()).collect();
    let d = BigIpDouble::start_with(DoubleConfig::default()).await;
    d.add_user(UserSpec::new("svc-llm", "pw-123", Role::ApplicationEditor));
    let mut pool = PoolSpec::new("/Common/llm_pool").mode("ratio-least-connections-member");
    for x in &t {
        pool = pool.member(MemberSpec::ip("127.0.0.1", x.addr.port()));
    }
    d.add_pool(pool);
    // mcpd restarts and a BIG-IP reboot, on the writes and reads the controller will make.
    d.inject(Fault::new(FaultKind::McpdLost).on("PATCH", "/mgmt/tm/").times(3));
    d.inject(Fault::new(FaultKind::Restarting).on("GET", "/members").times(2));

    let run = Running::start(&format!(
        "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ from_lb: true }}\n    sink:\n      kind: f5\n      url: '{}'\n      pool: /Common/llm_pool\n      username: svc-llm\n      password: {{ value: pw-123 }}\n      retries: 1\n      retry_backoff: 10ms\n",
        d.url()
    ));
    // Converged: the double holds exactly what the controller wants, busiest member lowest.
    let final_ratios =
        wait::until(Duration::from_secs(30), "BIG-IP to hold the controller's ratios", || async {
            let want = run.ratios("llm").await?;
            // Members are named address:port on the double, the same form as our member ids.
            let have = d.ratios("/Common/llm_pool");
            (want.len() == 3 && want == have && strictly_decreasing(&want, &order) && d.pending_faults() == 0)
                .then_some(want)
        })
        .await;
    assert_eq!(final_ratios.len(), 3);
    let metrics = run.metrics().await;
    assert!(metrics.contains("llmlc_pushes_total{pool=\"llm\",sink=\"f5\",outcome=\"pushed\"}"), "{metrics}");
    let log = run.log();
    let status = run.stop().await;
    assert!(status.success(), "{status:?}\n{log}");
    assert_eq!(d.live_tokens("svc-llm"), 0, "the login token is deleted on shutdown");
}

/// A management plane under load: every call takes 150 ms. 40 members, a 2 s interval: a push makes
/// about 45 calls, more than one interval one after another, so it must run with its own budget and
/// queue its PATCHes concurrently; the cycles meanwhile report `in_progress`, and one token serves it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_on_a_slow_management_plane_applies_forty_members_with_one_login() {
    let mut targets = Vec::new();
    for i in 0..40 {
        let f = f64::from(i) / 39.0;
        targets.push(MetricsTarget::vllm(8.0 * f, 4.0 + 40.0 * f, 0.1 + 0.8 * f).await);
    }
    let d = BigIpDouble::start_with(DoubleConfig {
        latency: Duration::from_millis(150),
        ..DoubleConfig::default()
    })
    .await;
    d.add_user(UserSpec::new("svc-llm", "pw-123", Role::ApplicationEditor));
    let mut pool = PoolSpec::new("/Common/llm_pool").mode("ratio-least-connections-member");
    for x in &targets {
        pool = pool.member(MemberSpec::ip("127.0.0.1", x.addr.port()));
    }
    d.add_pool(pool);
    let run = Running::start_every(
        "2s",
        &format!(
            "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ from_lb: true }}\n    sink:\n      kind: f5\n      url: '{}'\n      pool: /Common/llm_pool\n      username: svc-llm\n      password: {{ value: pw-123 }}\n",
            d.url()
        ),
    );
    let started = std::time::Instant::now();
    wait::until(Duration::from_secs(40), "BIG-IP to hold the controller's 40 ratios", || async {
        let want = run.ratios("llm").await?;
        let have = d.ratios("/Common/llm_pool");
        (want.len() == 40 && want == have && have.values().any(|&r| r != 1)).then_some(())
    })
    .await;
    let took = started.elapsed();
    let log = d.requests();
    let logins = log.iter().filter(|r| r.path == "/mgmt/shared/authn/login").count();
    assert!(logins <= 3, "{logins} logins");
    let open = d.transactions().into_iter().filter(|(_, state, _)| state == "STARTED").count();
    assert_eq!(open, 0, "a transaction was left open");
    eprintln!(
        "40 members at 150 ms per call: applied {took:?} after start, {logins} login(s), {} calls",
        log.len()
    );
    let status = run.stop().await;
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_weights_follow_load_and_survive_a_restart() {
    use llm_lc_testkit::haproxy::{standard_config, Haproxy};
    let t = targets().await;
    let order: Vec<String> = t.iter().map(|x| x.member()).collect();
    let servers: String =
        t.iter().enumerate().map(|(i, x)| format!("    server s{i} {} weight 1\n", x.member())).collect();
    let mut h = Haproxy::start(&standard_config(&format!(
        "backend llm\n    balance leastconn\n{servers}\nfrontend fe\n    bind 127.0.0.1:{{{{PORT:fe}}}}\n    default_backend llm\n"
    )))
    .await;
    let run = Running::start(&format!(
        "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ from_lb: true }}\n    sink: {{ kind: haproxy, address: '{}', backend: llm }}\n",
        h.runtime_address()
    ));
    let names = ["s0", "s1", "s2"];
    let in_haproxy = |w: &BTreeMap<String, u32>, want: &BTreeMap<String, u64>| {
        names.iter().zip(&order).all(|(n, m)| w.get(*n).map(|v| *v as u64) == want.get(m).copied())
    };
    wait::until(Duration::from_secs(20), "HAProxy to carry the controller's ratios", || async {
        let want = run.ratios("llm").await?;
        let w = h.state_weights("llm").await;
        (strictly_decreasing(&want, &order) && in_haproxy(&w, &want)).then_some(())
    })
    .await;
    // A restart drops runtime weights; the next cycles restore them.
    h.restart().await;
    wait::until(Duration::from_secs(10), "weights restored after the HAProxy restart", || async {
        let want = run.ratios("llm").await?;
        in_haproxy(&h.state_weights("llm").await, &want).then_some(())
    })
    .await;
    let status = run.stop().await;
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gets_weights_from_the_controllers_own_listener() {
    use llm_lc_testkit::envoy::Envoy;
    let t = targets().await;
    let order: Vec<String> = t.iter().map(|x| x.member()).collect();
    let list = order.iter().map(|m| format!("'{m}'")).collect::<Vec<_>>().join(", ");
    let run = Running::start(&format!(
        "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ static: [{list}] }}\n    sink: {{ kind: envoy, cluster: vllm }}\n"
    ));
    let envoy = Envoy::start_shipped_eds(run.listen).await;
    wait::until(Duration::from_secs(30), "Envoy to hold the controller's weights", || async {
        let want = run.ratios("llm").await?;
        let have = envoy.weights("vllm").await?;
        let have: BTreeMap<String, u64> = have.into_iter().map(|(k, v)| (k, v as u64)).collect();
        (strictly_decreasing(&want, &order) && have == want).then_some(())
    })
    .await;
    let status = run.stop().await;
    assert!(status.success());
}

/// The acceptance run: the simulated fleet behind a real HAProxy in leastconn mode, the
/// controller pushing weights; one replica slows to a fifth of its speed and gets a falling share.
/// Behind leastconn every server holds about as many requests, so only processing time tells the
/// slow one apart: the pool opts into `latency_weight` (off by default, see src/bench/RESULTS.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowed_replica_loses_traffic_behind_haproxy_leastconn() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use llm_lc_sim::{start_fleet, FleetConfig, ModelProfile};
    use llm_lc_testkit::haproxy::{standard_config, Haproxy};

    let fleet = start_fleet(FleetConfig::new(ModelProfile::tiny(), &[1.0, 1.0, 1.0])).await.expect("fleet");
    let addrs: Vec<String> = fleet.addrs().iter().map(|a| a.to_string()).collect();
    let servers: String =
        addrs.iter().enumerate().map(|(i, a)| format!("    server s{i} {a} weight 50\n")).collect();
    let h = Haproxy::start(&standard_config(&format!(
        "backend llm\n    balance leastconn\n{servers}\nfrontend fe\n    bind 127.0.0.1:{{{{PORT:fe}}}}\n    default_backend llm\n"
    )))
    .await;
    let run = Running::start(&format!(
        "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ from_lb: true }}\n    stale_after: 5s\n    grace: 2s\n    policy: {{ kind: feedback, gain: 0.3, latency_weight: 1 }}\n    sink: {{ kind: haproxy, address: '{}', backend: llm }}\n",
        h.runtime_address()
    ));

    // Twelve clients in a closed loop through HAProxy.
    let url = format!("http://127.0.0.1:{}/v1/completions", h.port("fe"));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for _ in 0..12 {
        let (url, stop) = (url.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let c = reqwest::Client::new();
            let body = serde_json::json!({"model": "sim-tiny", "prompt": "x".repeat(400), "max_tokens": 24, "ignore_eos": true});
            while !stop.load(Ordering::Relaxed) {
                let _ = c.post(&url).json(&body).timeout(Duration::from_secs(10)).send().await;
            }
        }));
    }
    // Requests served per replica: each has a 100-token prompt.
    let served = |fleet: &llm_lc_sim::Fleet| -> Vec<u64> {
        (0..3).map(|i| fleet.stats(i).map(|s| s.prompt_tokens_total / 100).unwrap_or(0)).collect()
    };

    fleet.set_speed(2, 0.2).expect("slow down replica 2");
    // The controller notices and gives the slowed replica the lowest weight in HAProxy.
    wait::until(Duration::from_secs(30), "HAProxy weight of the slowed replica to be the lowest", || async {
        let w = h.state_weights("llm").await;
        let (a, b, c) = (w.get("s0")?, w.get("s1")?, w.get("s2")?);
        (c * 2 < *a.min(b)).then_some(())
    })
    .await;
    // From then on it serves clearly less than an equal third.
    let before = served(&fleet);
    wait::until(Duration::from_secs(30), "enough requests to measure the split", || {
        let now = served(&fleet);
        let total: u64 = now.iter().zip(&before).map(|(n, b)| n - b).sum();
        async move { (total >= 300).then_some(()) }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    let after = served(&fleet);
    let delta: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let total: u64 = delta.iter().sum();
    assert!((delta[2] as f64) < 0.2 * total as f64, "slowed replica still served {delta:?}");
    let status = run.stop().await;
    assert!(status.success());
    fleet.shutdown().await;
}

/// Two HAProxy instances behind one pool: each one's state is a metric, so an instance that stopped
/// taking weights shows while the other keeps going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_haproxy_instance_reports_whether_it_took_the_push() {
    use llm_lc_testkit::haproxy::{standard_config, Haproxy};
    let t = targets().await;
    let servers: String =
        t.iter().enumerate().map(|(i, x)| format!("    server s{i} {} weight 1\n", x.member())).collect();
    let template = standard_config(&format!("backend llm\n    balance leastconn\n{servers}"));
    let one = Haproxy::start(&template).await;
    let mut two = Haproxy::start(&template).await;
    let (a, b) = (one.runtime_address(), two.runtime_tcp_address());
    let run = Running::start(&format!(
        "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ static: [{}] }}\n    sink: {{ kind: haproxy, addresses: ['{a}', '{b}'], backend: llm, timeout: 500ms }}\n",
        t.iter().map(|x| format!("'{}'", x.member())).collect::<Vec<_>>().join(", ")
    ));
    let gauge = |m: &str, addr: &str| {
        let prefix = format!("llmlc_sink_instance_ok{{pool=\"llm\",sink=\"haproxy\",instance=\"{addr}\"}} ");
        m.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.trim().parse::<f64>().ok())
    };
    wait::until(Duration::from_secs(20), "both instances took a push", || async {
        let m = run.metrics().await;
        (gauge(&m, &a) == Some(1.0) && gauge(&m, &b) == Some(1.0)).then_some(())
    })
    .await;
    two.stop().await;
    wait::until(Duration::from_secs(20), "the stopped instance shows 0, the other still 1", || async {
        let m = run.metrics().await;
        (gauge(&m, &a) == Some(1.0) && gauge(&m, &b) == Some(0.0)).then_some(())
    })
    .await;
    let status = run.stop().await;
    assert!(status.success());
}
