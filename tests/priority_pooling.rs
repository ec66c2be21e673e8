//! Priority pooling end to end on a real HAProxy: the controller binary keeps the remote tier at
//! weight 0 while the local tier has room, spills to it when the local tier saturates, and takes it
//! back out once the load fits the local tier again (below the lower threshold: hysteresis); tiers
//! can also be named by a label of the members' series in a real Prometheus (a Thanos external label
//! such as `cluster` in a real multi-cluster setup).

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use llm_lc_testkit::haproxy::{standard_config, Haproxy};
use llm_lc_testkit::metrics_target::{vllm_text, MetricsTarget};
use llm_lc_testkit::prometheus::Prometheus;
use llm_lc_testkit::{ports, wait};

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

struct Running(Child, tempfile::TempDir);

impl Running {
    /// `run --config cfg`, logging to `dir/stderr.log`; killed on drop.
    fn start(cfg: &std::path::Path, dir: tempfile::TempDir) -> Running {
        let child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(cfg)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr.log")).expect("log"))
            .spawn()
            .expect("start");
        Running(child, dir)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.1.path().join("stderr.log")).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn metrics(port: u16) -> String {
    match reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_remote_tier_gets_traffic_only_while_the_local_one_is_saturated() {
    // east (local): s0, s1; west (remote): s2, s3.
    let (east, west) = two_regions().await;
    let all: Vec<&MetricsTarget> = east.iter().chain(&west).collect();
    let servers: String =
        all.iter().enumerate().map(|(i, x)| format!("    server s{i} {} weight 1\n", x.member())).collect();
    let h = Haproxy::start(&standard_config(&format!(
        "backend llm\n    balance leastconn\n{servers}\nfrontend fe\n    bind 127.0.0.1:{{{{PORT:fe}}}}\n    default_backend llm\n"
    )))
    .await;
    let east_re = format!("127\\.0\\.0\\.1:({}|{})", east[0].addr.port(), east[1].addr.port());
    let dir = tempfile::tempdir().expect("tmp");
    let listen = ports::free_port();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "interval: 200ms\nlisten: 127.0.0.1:{listen}\nsources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ from_lb: true }}\n    priority:\n      tiers:\n        - {{ name: east, members: '{east_re}' }}\n        - {{ name: west }}\n      spill_at: 0.8\n      return_below: 0.6\n      return_hold: 1s\n    sink: {{ kind: haproxy, address: '{}', backend: llm, allow_drain: true }}\n",
            h.runtime_address()
        ),
    )
    .expect("config");
    let out = Command::new(BIN).args(["check", "--config"]).arg(&cfg).output().expect("check");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let run = Running::start(&cfg, dir);
    let weights = || async { h.state_weights("llm").await };
    let local_only = |w: &BTreeMap<String, u32>| {
        w.get("s0").is_some_and(|v| *v > 0)
            && w.get("s1").is_some_and(|v| *v > 0)
            && w.get("s2") == Some(&0)
            && w.get("s3") == Some(&0)
    };
    let spilled = |w: &BTreeMap<String, u32>| {
        ["s0", "s1", "s2", "s3"].iter().all(|s| w.get(*s).is_some_and(|v| *v > 0))
    };

    // 1. East at 30%: west carries nothing (weight 0 in HAProxy).
    wait::until(Duration::from_secs(20), "west at weight 0", || async {
        local_only(&weights().await).then_some(())
    })
    .await;

    // 2. East saturates: west gets weights.
    for t in &east {
        t.set(&vllm_text(20.0, 64.0, 0.97));
    }
    wait::until(Duration::from_secs(20), "spill to west", || async {
        spilled(&weights().await).then_some(())
    })
    .await;
    assert!(metrics(listen).await.contains("llmlc_pool_active_tiers{pool=\"llm\"} 2"));
    let report: serde_json::Value = reqwest::get(format!("http://127.0.0.1:{listen}/v1/ratios"))
        .await
        .expect("report")
        .json()
        .await
        .expect("JSON");
    assert_eq!(report["pools"][0]["active_tiers"], serde_json::json!(["east", "west"]), "{report}");

    // 3. Load between the thresholds (east 0.5 + west 0.3 over east alone = 0.8): west stays.
    // West first: east alone dropping to 0.5 with west still idle would be a real reason to return.
    for t in &west {
        t.set(&vllm_text(0.0, 8.0, 0.3));
    }
    for t in &east {
        t.set(&vllm_text(0.0, 16.0, 0.5));
    }
    // Several cycles at these loads (the scrape sees them within one), and nothing moves back.
    let cycles = |text: String| -> u64 {
        text.lines()
            .filter(|l| l.starts_with("llmlc_cycles_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    let c0 = cycles(metrics(listen).await);
    wait::until(Duration::from_secs(10), "five cycles", || async {
        (cycles(metrics(listen).await) >= c0 + 5).then_some(())
    })
    .await;
    assert!(spilled(&weights().await), "returned while the load would not fit east: {:?}", weights().await);

    // 4. Load falls: (2 x 0.2 + 2 x 0.1) / 2 = 0.3 < 0.6: west back to 0.
    for t in &east {
        t.set(&vllm_text(0.0, 4.0, 0.2));
    }
    for t in &west {
        t.set(&vllm_text(0.0, 2.0, 0.1));
    }
    wait::until(Duration::from_secs(20), "west back to weight 0", || async {
        local_only(&weights().await).then_some(())
    })
    .await;
    let log = run.log();
    assert_eq!(log.matches("spilled over to the next tier").count(), 1, "{log}");
    assert_eq!(log.matches("returned from the last tier").count(), 1, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_keeps_the_inactive_tier_at_priority_one() {
    use llm_lc_testkit::envoy::Envoy;
    let (east, west) = two_regions().await;
    let (east_ids, west_ids) = (ids(&east), ids(&west));
    let list = east_ids.iter().chain(&west_ids).map(|m| format!("'{m}'")).collect::<Vec<_>>().join(", ");
    let east_re = format!("127\\.0\\.0\\.1:({}|{})", east[0].addr.port(), east[1].addr.port());
    let dir = tempfile::tempdir().expect("tmp");
    let listen = ports::free_port();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "interval: 200ms\nlisten: 127.0.0.1:{listen}\nsources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ static: [{list}] }}\n    priority:\n      tiers:\n        - {{ name: east, members: '{east_re}' }}\n        - {{ name: west }}\n      spill_at: 0.8\n    sink: {{ kind: envoy, cluster: vllm, priority_levels: true }}\n"
        ),
    )
    .expect("config");
    let _run = Running::start(&cfg, dir);
    let envoy = Envoy::start_shipped_eds(listen).await;
    let levels = |p: &BTreeMap<String, u32>, ids: &[String]| -> Vec<Option<u32>> {
        ids.iter().map(|m| p.get(m).copied()).collect()
    };
    // East has room: every member is in Envoy, west at priority 1 (standby), east at 0.
    wait::until(Duration::from_secs(30), "west at priority 1 in Envoy", || async {
        let p = envoy.priorities("vllm").await?;
        (levels(&p, &east_ids) == [Some(0), Some(0)] && levels(&p, &west_ids) == [Some(1), Some(1)])
            .then_some(())
    })
    .await;
    // East saturates: everything at priority 0.
    for t in &east {
        t.set(&vllm_text(20.0, 64.0, 0.97));
    }
    wait::until(Duration::from_secs(30), "west promoted to priority 0", || async {
        let p = envoy.priorities("vllm").await?;
        (levels(&p, &west_ids) == [Some(0), Some(0)] && p.len() == 4).then_some(())
    })
    .await;
    assert_eq!(envoy.stat("cluster.vllm.update_rejected").await.unwrap_or(0), 0, "{}", envoy.log());
}

/// Two members per region: east (local) at 30% KV with 8 running, west (remote) idle.
async fn two_regions() -> ([MetricsTarget; 2], [MetricsTarget; 2]) {
    let east = [MetricsTarget::vllm(0.0, 8.0, 0.3).await, MetricsTarget::vllm(0.0, 8.0, 0.3).await];
    let west = [MetricsTarget::vllm(0.0, 0.0, 0.0).await, MetricsTarget::vllm(0.0, 0.0, 0.0).await];
    (east, west)
}

fn ids(targets: &[MetricsTarget]) -> Vec<String> {
    targets.iter().map(|t| t.member()).collect()
}

/// One `run --once --dry-run --output json` of `cfg`: the pool's report.
fn once(cfg: &std::path::Path) -> serde_json::Value {
    let out = Command::new(BIN)
        .args(["run", "--dry-run", "--once", "--output", "json", "--config"])
        .arg(cfg)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON in {stdout}"));
    let report: serde_json::Value = serde_json::from_str(line).expect("JSON");
    report["pools"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_named_by_a_prometheus_label_spill_by_cluster() {
    // Every member is 127.0.0.1:<port>: only the `cluster` label Prometheus attaches tells the
    // clusters apart, as a Thanos external label does across real clusters.
    let (east, west) = two_regions().await;
    let (east_ids, west_ids) = (ids(&east), ids(&west));
    let prom = Prometheus::start_labelled(
        "vllm",
        &[(&[("cluster", "east-1")], &east_ids), (&[("cluster", "west-1")], &west_ids)],
    )
    .await;
    prom.wait_for_series("vllm:num_requests_waiting", 8, Duration::from_secs(30)).await;
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "listen: 127.0.0.1:0\nsources:\n  thanos: {{ kind: prometheus, url: '{}' }}\npools:\n  - name: llm\n    source: thanos\n    selector: 'job=\"vllm\"'\n    members: {{ prometheus_up: '{{job=\"vllm\"}}' }}\n    priority:\n      tiers:\n        - {{ name: east, labels: {{ cluster: 'east-.*' }} }}\n        - {{ name: west }}\n      spill_at: 0.8\n",
            prom.url()
        ),
    )
    .expect("config");
    let ratio_of = |pool: &serde_json::Value, id: &str| -> (u64, String) {
        let m = pool["members"].as_array().expect("members").iter().find(|m| m["member"] == id).cloned();
        let m = m.unwrap_or_else(|| panic!("{id} missing in {pool}"));
        (m["ratio"].as_u64().expect("ratio"), m["tier"].as_str().unwrap_or_default().to_string())
    };

    // East has room: west members are in tier west at ratio 0, east ones in tier east above 0.
    let pool = once(&cfg);
    assert_eq!(pool["active_tiers"], serde_json::json!(["east"]), "{pool}");
    for id in &east_ids {
        let (r, tier) = ratio_of(&pool, id);
        assert!(r > 0 && tier == "east", "{id}: {r} {tier}: {pool}");
    }
    for id in &west_ids {
        assert_eq!(ratio_of(&pool, id), (0, "west".to_string()), "{pool}");
    }

    // East saturates (as Prometheus sees it): the pool spills to west.
    for t in &east {
        t.set(&vllm_text(20.0, 64.0, 0.97));
    }
    wait::until(Duration::from_secs(20), "Prometheus sees east saturated", || async {
        let rows = prom.query("sum(vllm:num_requests_waiting{cluster=\"east-1\"})").await;
        let v = rows.first().and_then(|r| r["value"][1].as_str()?.parse::<f64>().ok());
        (v == Some(40.0)).then_some(())
    })
    .await;
    let pool = once(&cfg);
    assert_eq!(pool["active_tiers"], serde_json::json!(["east", "west"]), "{pool}");
    for id in &west_ids {
        let (r, tier) = ratio_of(&pool, id);
        assert!(r > 0 && tier == "west", "{id}: {r} {tier}: {pool}");
    }
}

#[test]
fn sinks_that_cannot_express_an_inactive_tier_are_refused_by_check() {
    let dir = tempfile::tempdir().expect("tmp");
    let check = |sink: &str| {
        let p = dir.path().join("c.yaml");
        std::fs::write(
            &p,
            format!("sources:\n  direct: {{ kind: scrape }}\npools:\n  - name: llm\n    source: direct\n    members: {{ static: ['10.1.0.1:80', '10.2.0.1:80'] }}\n    priority: {{ tiers: [{{ name: east, members: '10\\.1\\..*' }}, {{ name: west }}] }}\n    sink: {sink}\n"),
        )
        .expect("write");
        let out = Command::new(BIN).args(["check", "--config"]).arg(&p).output().expect("check");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = check("{ kind: haproxy, address: '127.0.0.1:9999', backend: llm }");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("c.yaml: pools[0].priority: needs `sink.allow_drain: true`"), "{err}");
    let (code, err) =
        check("{ kind: f5, url: 'https://bigip', pool: /Common/p, username: u, password: { value: p } }");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("pools[0].priority: needs `sink.priority_groups: true`"), "{err}");
    let (code, err) = check(
        "{ kind: f5, url: 'https://bigip', pool: /Common/p, username: u, password: { value: p }, mode: sideband }",
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("pools[0].priority: not supported with the f5 sink in sideband mode"), "{err}");
    let (code, err) = check(
        "{ kind: f5, url: 'https://bigip', pool: /Common/p, username: u, password: { value: p }, priority_groups: true }",
    );
    assert_eq!(code, Some(0), "{err}");
    let (code, err) = check("{ kind: envoy, cluster: vllm }");
    assert_eq!(code, Some(0), "{err}");
    // Tiers by label need series labels, which a scrape source does not have.
    let p = dir.path().join("c.yaml");
    std::fs::write(
        &p,
        "sources:\n  direct: { kind: scrape }\npools:\n  - name: llm\n    source: direct\n    members: { static: ['10.1.0.1:80'] }\n    priority: { tiers: [{ name: east, labels: { cluster: east } }, { name: west }] }\n    sink: { kind: envoy, cluster: vllm }\n",
    )
    .expect("write");
    let out = Command::new(BIN).args(["check", "--config"]).arg(&p).output().expect("check");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("pools[0].priority.tiers[0].labels: needs a prometheus source"), "{err}");
}
