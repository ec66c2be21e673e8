//! The first step of the OpenShift guide, for each shipped overlay config: `run --dry-run --once`
//! reads the load balancer's membership (read-only), prints a ratio for every member, writes nothing
//! and exits 0.
//!
//! Each overlay's `controller.yaml` is used as shipped, with only what is site-specific pointed at
//! loopback: Thanos becomes a real Prometheus scraping three vLLM-shaped pages, the series selector
//! becomes that scrape job, credentials and CA files become temp files (or plain http), and the load
//! balancer is the BIG-IP double, a real HAProxy, or a real Envoy.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use llm_lc_testkit::bigip::{BigIpDouble, MemberSpec, PoolSpec, Role, UserSpec};
use llm_lc_testkit::haproxy::{standard_config, Haproxy};
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::prometheus::Prometheus;
use serde_yaml_ng::Value;

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

fn overlay(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/openshift/overlays")
        .join(name)
        .join("controller.yaml");
    serde_yaml_ng::from_str(&std::fs::read_to_string(&p).expect("read overlay config")).expect("overlay YAML")
}

/// Set `path` (dot-separated, `pools.0.sink.url`) in `v`; the key must exist unless `create`.
fn set(v: &mut Value, path: &str, to: Value) {
    let mut cur = v;
    let keys: Vec<&str> = path.split('.').collect();
    for (i, k) in keys.iter().enumerate() {
        let last = i + 1 == keys.len();
        cur = match k.parse::<usize>() {
            Ok(n) => &mut cur[n],
            Err(_) => {
                let map = cur.as_mapping_mut().unwrap_or_else(|| panic!("{path}: {k} is not in a mapping"));
                if last {
                    map.insert(Value::from(*k), to);
                    return;
                }
                map.get_mut(*k).unwrap_or_else(|| panic!("{path}: no key {k} in the shipped overlay"))
            }
        };
    }
    *cur = to;
}

fn remove(v: &mut Value, path: &str) {
    let (parent, key) = path.rsplit_once('.').unwrap_or(("", path));
    let mut cur = v;
    for k in parent.split('.').filter(|k| !k.is_empty()) {
        cur = match k.parse::<usize>() {
            Ok(n) => &mut cur[n],
            Err(_) => cur.get_mut(k).unwrap_or_else(|| panic!("{path}: no key {k}")),
        };
    }
    let removed = cur.as_mapping_mut().and_then(|m| m.remove(key));
    assert!(removed.is_some(), "{path}: not in the shipped overlay");
}

struct Lab {
    targets: Vec<MetricsTarget>,
    prometheus: Prometheus,
    dir: tempfile::TempDir,
}

impl Lab {
    async fn start() -> Lab {
        let targets = vec![
            MetricsTarget::vllm(0.0, 2.0, 0.10).await,
            MetricsTarget::vllm(2.0, 20.0, 0.50).await,
            MetricsTarget::vllm(12.0, 60.0, 0.95).await,
        ];
        let addrs: Vec<String> = targets.iter().map(MetricsTarget::member).collect();
        let prometheus = Prometheus::start("vllm", &addrs).await;
        // Every target scraped: its `up` and its series.
        prometheus.wait_for_series(r#"up{job="vllm"}"#, 3, Duration::from_secs(30)).await;
        prometheus
            .wait_for_series("count by (instance) (vllm:num_requests_waiting)", 3, Duration::from_secs(30))
            .await;
        Lab { targets, prometheus, dir: tempfile::tempdir().expect("tmp") }
    }

    fn members(&self) -> Vec<String> {
        self.targets.iter().map(MetricsTarget::member).collect()
    }

    fn file(&self, name: &str, body: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, body).expect("write");
        p
    }

    /// The overlay with its source pointed at the lab's Prometheus, and no leader election (a dry
    /// run never takes the Lease anyway, and there is no API server here).
    fn localize(&self, name: &str) -> Value {
        let mut cfg = overlay(name);
        remove(&mut cfg, "leader_election");
        set(&mut cfg, "sources.thanos.url", Value::from(self.prometheus.url()));
        remove(&mut cfg, "sources.thanos.ca_file");
        let token = self.file("sa-token", "token-for-thanos\n");
        set(&mut cfg, "sources.thanos.bearer_token.file", Value::from(token.display().to_string()));
        set(&mut cfg, "pools.0.selector", Value::from(r#"job="vllm""#));
        cfg
    }

    /// `run --dry-run --once --output json` on `cfg`; asserts success and a ratio of at least 1 for
    /// exactly the lab's members. Returns the cycle's JSON.
    fn dry_run_once(&self, name: &str, cfg: &Value) -> serde_json::Value {
        let path = self.file(&format!("{name}.yaml"), &serde_yaml_ng::to_string(cfg).expect("yaml"));
        let check = Command::new(BIN).args(["check", "--config"]).arg(&path).output().expect("check");
        assert!(check.status.success(), "{name}: check: {}", String::from_utf8_lossy(&check.stderr));
        let out = Command::new(BIN)
            .args(["run", "--dry-run", "--once", "--output", "json", "--config"])
            .arg(&path)
            .output()
            .expect("run");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);
        let line = stdout
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap_or_else(|| panic!("{name}: no JSON: {stdout}"));
        let report: serde_json::Value = serde_json::from_str(line).expect("cycle JSON");
        let mut printed: Vec<(String, u64)> = report["pools"][0]["members"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: no members in {report}"))
            .iter()
            .map(|m| (m["member"].as_str().unwrap_or_default().to_string(), m["ratio"].as_u64().unwrap_or(0)))
            .collect();
        printed.sort();
        let mut want = self.members();
        want.sort();
        let names: Vec<String> = printed.iter().map(|(m, _)| m.clone()).collect();
        assert_eq!(names, want, "{name}: every member, and only them:\n{report}");
        assert!(printed.iter().all(|(_, r)| *r >= 1), "{name}: a ratio for every member: {printed:?}");
        assert_eq!(report["pools"][0]["push"], "dry_run", "{name}: {report}");
        report
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bigip_overlay_dry_run_reads_the_pool_and_writes_nothing() {
    let lab = Lab::start().await;
    let bigip = BigIpDouble::start().await;
    bigip.add_user(UserSpec::new("svc-llm", "pw", Role::ApplicationEditor));
    let mut pool = PoolSpec::new("/Common/llm_pool").mode("ratio-least-connections-member");
    for m in lab.members() {
        let (addr, port) = m.rsplit_once(':').expect("addr:port");
        pool = pool.member(MemberSpec::ip(addr, port.parse().expect("port")));
    }
    bigip.add_pool(pool);

    let mut cfg = lab.localize("bigip");
    set(&mut cfg, "pools.0.sink.url", Value::from(bigip.url()));
    remove(&mut cfg, "pools.0.sink.ca_file");
    let user = lab.file("username", "svc-llm\n");
    let pw = lab.file("password", "pw\n");
    set(&mut cfg, "pools.0.sink.username.file", Value::from(user.display().to_string()));
    set(&mut cfg, "pools.0.sink.password.file", Value::from(pw.display().to_string()));
    let out = lab.dry_run_once("bigip", &cfg);

    let log = bigip.requests();
    assert!(log.iter().any(|r| r.method == "GET" && r.path.ends_with("/members")), "membership read: {out}");
    let writes: Vec<_> =
        log.iter().filter(|r| r.method != "GET" && !r.path.starts_with("/mgmt/shared/")).collect();
    assert!(writes.is_empty(), "a dry run wrote to BIG-IP: {writes:?}");
    assert!(bigip.ratios("/Common/llm_pool").values().all(|&r| r == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_overlay_dry_run_reads_the_backend_and_writes_nothing() {
    let lab = Lab::start().await;
    let servers: String =
        lab.members().iter().enumerate().map(|(i, m)| format!("    server s{i} {m} weight 10\n")).collect();
    let haproxy =
        Haproxy::start(&standard_config(&format!("backend llm\n    balance leastconn\n{servers}"))).await;
    let before = haproxy.state_weights("llm").await;

    let mut cfg = lab.localize("haproxy");
    set(&mut cfg, "pools.0.sink.address", Value::from(haproxy.runtime_tcp_address()));
    lab.dry_run_once("haproxy", &cfg);
    assert_eq!(haproxy.state_weights("llm").await, before, "a dry run changed HAProxy's weights");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_overlay_dry_run_prints_every_member() {
    // As shipped: members are Prometheus's `up` targets (Envoy has no pool of its own to ask).
    let lab = Lab::start().await;
    let mut cfg = lab.localize("envoy");
    set(&mut cfg, "pools.0.members.prometheus_up", Value::from(r#"{job="vllm"}"#));
    lab.dry_run_once("envoy", &cfg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_dry_run_with_from_lb_reads_the_cluster_from_the_admin_api() {
    use llm_lc_testkit::envoy::Envoy;
    let lab = Lab::start().await;
    let endpoints: String = lab
        .members()
        .iter()
        .map(|m| {
            let (a, p) = m.rsplit_once(':').expect("addr:port");
            format!(
                "        - endpoint: {{ address: {{ socket_address: {{ address: {a}, port_value: {p} }} }} }}\n"
            )
        })
        .collect();
    let envoy = Envoy::start(&format!(
        "admin:\n  address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}\n\
         static_resources:\n  clusters:\n  - name: vllm\n    type: STATIC\n    connect_timeout: 1s\n    \
         load_assignment:\n      cluster_name: vllm\n      endpoints:\n      - lb_endpoints:\n{endpoints}"
    ))
    .await;
    let mut cfg = lab.localize("envoy");
    remove(&mut cfg, "pools.0.members.prometheus_up");
    set(&mut cfg, "pools.0.members.from_lb", Value::from(true));
    set(&mut cfg, "pools.0.sink.admin", Value::from(envoy.admin_url().to_string()));
    lab.dry_run_once("envoy-from-lb", &cfg);
}
