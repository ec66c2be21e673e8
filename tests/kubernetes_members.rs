//! Members from a Kubernetes Service's EndpointSlices, end to end: the controller binary against the
//! fake API server (tests/support/src/kube.rs) and live metrics pages. Ready endpoints only, other
//! Services' slices ignored, pods coming and going followed cycle by cycle, a missing RBAC rule
//! reported with what to grant, and config errors naming file and field.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use llm_lc_testkit::kube::FakeKube;
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::{ports, wait};

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");
const NS: &str = "llm-serving";

fn cmd() -> Command {
    let mut c = Command::new(BIN);
    // The test machine may run in a pod: the controller must only see the fake API server.
    c.env_remove("KUBERNETES_SERVICE_HOST").env_remove("KUBERNETES_SERVICE_PORT").env_remove("POD_NAMESPACE");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("LLMLC_") {
            c.env_remove(&k);
        }
    }
    c
}

struct Running {
    child: Child,
    listen: u16,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Running {
    fn start(api: &str, token: &str) -> Running {
        Running::start_with(&format!(
            "service: vllm, namespace: {NS}, port: http, api_url: '{api}', token: {{ value: {token} }}"
        ))
    }

    /// The controller, dry run, with `members: { kubernetes: { MEMBERS } }`.
    fn start_with(members: &str) -> Running {
        let dir = tempfile::tempdir().expect("tmp");
        let listen = ports::free_port();
        let cfg = dir.path().join("c.yaml");
        std::fs::write(
            &cfg,
            format!(
                "interval: 200ms\nlisten: 127.0.0.1:{listen}\nleader_election: {{ enabled: false }}\nsources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members:\n      kubernetes: {{ {members} }}\n"
            ),
        )
        .expect("config");
        let log = dir.path().join("stderr.log");
        let child = cmd()
            .args(["run", "--dry-run", "--config"])
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("start controller");
        Running { child, listen, log, _dir: dir }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Members of the last cycle's report that have a ratio.
    async fn members(&self) -> Option<BTreeSet<String>> {
        let v: serde_json::Value = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{}/v1/ratios", self.listen))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let pool = v["pools"].as_array()?.iter().find(|p| p["pool"] == "llm")?;
        Some(
            pool["members"]
                .as_array()?
                .iter()
                .filter_map(|m| Some(m["member"].as_str()?.to_string()))
                .collect(),
        )
    }

    async fn wait_members(&self, want: &BTreeSet<String>, what: &str) {
        wait::until(Duration::from_secs(20), what, || async {
            (self.members().await.as_ref() == Some(want)).then_some(())
        })
        .await;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One slice per pod, as Kubernetes makes when a named target port resolves to a different number
/// on each pod: here each pod's "http" port is its own metrics page's port.
fn put_pod(kube: &FakeKube, slice: &str, service: &str, t: &MetricsTarget, ready: Option<bool>) {
    kube.put_endpoint_slice(NS, slice, service, "IPv4", &[("127.0.0.1", ready)], &[("http", t.addr.port())]);
}

fn set(items: &[&MetricsTarget]) -> BTreeSet<String> {
    items.iter().map(|t| t.member()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_follow_the_ready_endpoints_of_the_service() {
    let kube = FakeKube::start(&["t1"]).await;
    let a = MetricsTarget::vllm(0.0, 2.0, 0.1).await;
    let b = MetricsTarget::vllm(4.0, 30.0, 0.7).await;
    let c = MetricsTarget::vllm(1.0, 8.0, 0.3).await;
    let other = MetricsTarget::vllm(0.0, 1.0, 0.1).await;
    put_pod(&kube, "vllm-a", "vllm", &a, Some(true));
    put_pod(&kube, "vllm-b", "vllm", &b, None); // no condition: ready, says Kubernetes
    put_pod(&kube, "vllm-c", "vllm", &c, Some(false)); // starting, not ready yet
    put_pod(&kube, "other-x", "other", &other, Some(true)); // another Service in the namespace

    let run = Running::start(&kube.url(), "t1");
    run.wait_members(&set(&[&a, &b]), "the ready endpoints of Service vllm").await;

    // c turns ready, a's pod goes away: the pool follows within a few cycles.
    put_pod(&kube, "vllm-c", "vllm", &c, Some(true));
    kube.delete_endpoint_slice(NS, "vllm-a");
    run.wait_members(&set(&[&b, &c]), "c in, a out").await;
    let log = run.log();
    assert!(log.contains("member joined the pool") && log.contains("member left the pool"), "{log}");
    assert!(kube.endpoint_slice_lists() >= 2, "one LIST per cycle");
    assert!(kube.errors().is_empty(), "requests the API server would refuse: {:?}", kube.errors());

    // The API server goes away: the last known members stay.
    kube.set_down_for("t1", true);
    let lists = kube.endpoint_slice_lists();
    wait::until(Duration::from_secs(10), "discovery to fail", || async {
        run.log().contains("member discovery failed; keeping the last known members").then_some(())
    })
    .await;
    assert_eq!(run.members().await, Some(set(&[&b, &c])));
    assert_eq!(kube.endpoint_slice_lists(), lists, "a 503 is not a served list");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_rbac_rule_is_reported_with_what_to_grant() {
    let kube = FakeKube::start(&["t1"]).await;
    kube.deny_endpoint_slices_for("t1");
    let run = Running::start(&kube.url(), "t1");
    let log = wait::until(Duration::from_secs(20), "the discovery error in the log", || async {
        let l = run.log();
        l.contains("member discovery failed").then_some(l)
    })
    .await;
    assert!(log.contains("cannot list resource"), "the API server's own words: {log}");
    assert!(log.contains("list on endpointslices.discovery.k8s.io"), "{log}");
    assert!(log.contains("deploy/openshift/base/rbac.yaml"), "{log}");
}

fn check(dir: &Path, members: &str) -> std::process::Output {
    let p = dir.join("c.yaml");
    std::fs::write(
        &p,
        format!("sources:\n  direct: {{ kind: scrape }}\npools:\n  - name: llm\n    source: direct\n    members:\n      {members}\n"),
    )
    .expect("write");
    cmd().args(["check", "--config"]).arg(&p).output().expect("check")
}

#[test]
fn config_errors_name_file_line_and_field_and_the_plan_shows_the_service() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = check(dir.path(), "kubernetes: { service: Vllm_Svc, namespace: llm, port: 0 }");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("c.yaml: pools[0].members.kubernetes.service: \"Vllm_Svc\" is not a Service name"),
        "{err}"
    );
    assert!(err.contains("pools[0].members.kubernetes.port: must be 1..65535"), "{err}");

    let out = check(dir.path(), "kubernetes: { servce: vllm }");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("c.yaml:7:") && err.contains("servce"), "{err}");

    let out = check(dir.path(), "{ kubernetes: { service: vllm }, static: ['10.0.0.1:80'] }");
    assert!(String::from_utf8_lossy(&out.stderr).contains("set exactly one of"), "two forms");

    let out = check(dir.path(), "kubernetes: { service: vllm, namespace: llm, port: http }");
    let plan = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&plan).expect("YAML plan");
    let k = &doc["pools"][0]["members"]["kubernetes"];
    assert_eq!(k["service"].as_str(), Some("vllm"), "{plan}");
    assert_eq!(k["port"].as_str(), Some("http"), "{plan}");
}

/// An example config's Kubernetes members, and the Role and RoleBinding of an RBAC manifest (paths
/// from the repository's root).
fn example_and_rbac(
    config: &str,
    rbac: &str,
) -> (
    llm_load_controller::source::kubernetes::KubernetesMembers,
    k8s_openapi::api::rbac::v1::Role,
    k8s_openapi::api::rbac::v1::RoleBinding,
) {
    use serde::Deserialize;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cfg_path = root.join(config);
    let text = std::fs::read_to_string(&cfg_path).expect("example config");
    let cfg: llm_load_controller::config::Config =
        llm_load_controller::config::deserialize_yaml(&cfg_path, &text).expect("example parses");
    let k = cfg.pools[0].members.kubernetes.clone().expect("kubernetes members");
    let rbac = std::fs::read_to_string(root.join(rbac)).expect("rbac");
    let docs: Vec<serde_yaml_ng::Value> = serde_yaml_ng::Deserializer::from_str(&rbac)
        .map(|d| serde_yaml_ng::Value::deserialize(d).expect("YAML"))
        .collect();
    let role = serde_yaml_ng::from_value(docs[0].clone()).expect("Role");
    let rb = serde_yaml_ng::from_value(docs[1].clone()).expect("RoleBinding");
    (k, role, rb)
}

/// The shipped RBAC lets the controller's service account list EndpointSlices in the namespace the
/// example config reads its Service from, and nothing more.
#[test]
fn the_rbac_manifest_grants_what_the_example_config_needs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (k, role, rb) = example_and_rbac(
        "config/openshift-kubernetes-members.yaml",
        "deploy/openshift/kubernetes-members/rbac.yaml",
    );
    let ns = k.namespace.expect("the example names its namespace");
    assert_eq!(role.metadata.namespace.as_deref(), Some(ns.as_str()));
    assert_eq!(rb.metadata.namespace.as_deref(), Some(ns.as_str()));
    let rules = role.rules.expect("rules");
    assert_eq!(rules.len(), 1, "nothing but EndpointSlices");
    let r = &rules[0];
    assert_eq!(r.api_groups.as_deref(), Some(&["discovery.k8s.io".to_string()][..]));
    assert_eq!(r.resources.as_deref(), Some(&["endpointslices".to_string()][..]));
    assert!(r.verbs.contains(&"list".to_string()), "the controller lists");
    assert!(
        r.verbs.iter().all(|v| ["get", "list", "watch"].contains(&v.as_str())),
        "read-only: {:?}",
        r.verbs
    );
    assert_eq!(
        (rb.role_ref.kind.as_str(), rb.role_ref.name.as_str()),
        ("Role", role.metadata.name.as_deref().unwrap_or(""))
    );
    // The subject is the service account of deploy/openshift/base.
    let sa = std::fs::read_to_string(root.join("deploy/openshift/base/serviceaccount.yaml")).expect("sa");
    let sa: k8s_openapi::api::core::v1::ServiceAccount =
        serde_yaml_ng::from_str(&sa).expect("ServiceAccount");
    let base_ns = "llm-load-controller"; // deploy/openshift/base/kustomization.yaml's namespace
    let subjects = rb.subjects.expect("subjects");
    assert!(
        subjects.iter().any(|s| s.kind == "ServiceAccount"
            && Some(&s.name) == sa.metadata.name.as_ref()
            && s.namespace.as_deref() == Some(base_ns)),
        "{subjects:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_can_follow_the_zone_of_each_endpoint() {
    let kube = FakeKube::start(&["t1"]).await;
    let near = [MetricsTarget::vllm(0.0, 8.0, 0.3).await, MetricsTarget::vllm(0.0, 8.0, 0.3).await];
    let far = MetricsTarget::vllm(0.0, 0.0, 0.0).await;
    for (i, (t, zone)) in near.iter().map(|t| (t, "zone-a")).chain([(&far, "zone-b")]).enumerate() {
        let slice = format!("vllm-{i}");
        put_pod(&kube, &slice, "vllm", t, Some(true));
        kube.set_endpoint_zone(NS, &slice, zone, &format!("worker-{i}"));
    }
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "listen: 127.0.0.1:0\nleader_election: {{ enabled: false }}\nsources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members:\n      kubernetes: {{ service: vllm, namespace: {NS}, port: http, api_url: '{}', token: {{ value: t1 }} }}\n    priority:\n      tiers:\n        - {{ name: same-zone, labels: {{ zone: zone-a }} }}\n        - {{ name: other-zones }}\n",
            kube.url()
        ),
    )
    .expect("config");
    let out = cmd()
        .args(["run", "--dry-run", "--once", "--output", "json", "--config"])
        .arg(&cfg)
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON in {stdout}"));
    let report: serde_json::Value = serde_json::from_str(line).expect("JSON");
    let pool = &report["pools"][0];
    assert_eq!(pool["active_tiers"], serde_json::json!(["same-zone"]), "{pool}");
    let by_member = |t: &MetricsTarget| {
        let m =
            pool["members"].as_array().expect("members").iter().find(|m| m["member"] == t.member()).cloned();
        let m = m.unwrap_or_else(|| panic!("{} missing: {pool}", t.member()));
        (m["tier"].as_str().unwrap_or_default().to_string(), m["ratio"].as_u64().unwrap_or_default())
    };
    for t in &near {
        let (tier, ratio) = by_member(t);
        assert!(tier == "same-zone" && ratio > 0, "{tier} {ratio}: {pool}");
    }
    assert_eq!(by_member(&far), ("other-zones".to_string(), 0), "{pool}");

    // `region` is no endpoint label: refused by check, with the field named.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, std::fs::read_to_string(&cfg).expect("read").replace("zone: zone-a", "region: a"))
        .expect("write");
    let out = cmd().args(["check", "--config"]).arg(&bad).output().expect("check");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("pools[0].priority.tiers[0].labels"), "{err}");
}

/// Distinct `member` label values on a metrics page.
fn member_labels(page: &str) -> BTreeSet<String> {
    let re = regex::Regex::new(r#"[{,]member="([^"\\]*)""#).expect("regex");
    re.captures_iter(page).map(|c| c[1].to_string()).collect()
}

/// Members churn: every two cycles the Service's endpoints are 10 new pods (8 answering, so
/// each has its gauges; 2 not, so each has a `member_errors_total` series), and a hostile address
/// beside them. The page only ever holds the current and the previous generation, the hostile
/// address never, and once churning stops only the last generation is left within two cycles.
/// `LLMLC_CHURN_SECS` sets the length (default 15 s; the issue's soak is minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churning_members_leave_no_series_behind() {
    let secs: u64 = std::env::var("LLMLC_CHURN_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(15);
    let kube = FakeKube::start(&["t1"]).await;
    // One slice per pod, each on its own port (a named target port, as in `put_pod`).
    async fn generation(kube: &FakeKube, g: usize) -> (Vec<MetricsTarget>, BTreeSet<String>) {
        let mut live = Vec::new();
        let mut ids = BTreeSet::new();
        for i in 0..10 {
            let port = if i < 8 {
                let t = MetricsTarget::vllm(1.0, 4.0, 0.3).await;
                let p = t.addr.port();
                live.push(t);
                p
            } else {
                ports::free_port()
            };
            kube.put_endpoint_slice(
                NS,
                &format!("churn-{g}-{i}"),
                "vllm",
                "IPv4",
                &[("127.0.0.1", Some(true))],
                &[("http", port)],
            );
            ids.insert(format!("127.0.0.1:{port}"));
        }
        (live, ids)
    }
    let retire = |g: usize| {
        for i in 0..10 {
            kube.delete_endpoint_slice(NS, &format!("churn-{g}-{i}"));
        }
    };
    kube.put_endpoint_slice(
        NS,
        "hostile",
        "vllm",
        "IPv4",
        &[("10.0.0.1:1\"} 1\nllmlc_forged_series", Some(true))],
        &[("http", 1)],
    );
    let (mut pods, mut ids) = generation(&kube, 0).await;
    let run = Running::start(&kube.url(), "t1");
    let metrics = || async {
        reqwest::get(format!("http://127.0.0.1:{}/metrics", run.listen)).await.ok()?.text().await.ok()
    };
    let first = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if metrics().await.is_some_and(|p| member_labels(&p) == ids) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    if first.is_err() {
        panic!(
            "the first generation never on the page: {}\n{}",
            metrics().await.unwrap_or_default(),
            run.log()
        );
    }

    let start = std::time::Instant::now();
    let (mut g, mut most, mut most_lines, mut pages) = (0, 0, 0, 0);
    while start.elapsed() < Duration::from_secs(secs) {
        g += 1;
        let (new_pods, new_ids) = generation(&kube, g).await;
        retire(g - 1);
        let live: BTreeSet<String> = ids.union(&new_ids).cloned().collect();
        // Two cycles of 200 ms per generation, the page read in between.
        for _ in 0..2 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let Some(page) = metrics().await else { continue };
            assert!(!page.lines().any(|l| l.starts_with("llmlc_forged_series")), "{page}");
            let seen = member_labels(&page);
            assert!(
                seen.is_subset(&live),
                "generation {g}: series of members long gone: {:?}",
                seen.difference(&live)
            );
            most = most.max(seen.len());
            most_lines = most_lines.max(page.lines().filter(|l| l.contains("member=\"")).count());
            pages += 1;
        }
        (pods, ids) = (new_pods, new_ids);
    }
    assert!(g >= 10 && pages >= 10, "churned {g} generations, read {pages} pages");
    // 16 gauge families per member at most, and an error series.
    assert!(
        most <= 20 && most_lines <= 20 * 17,
        "at most two generations: {most} members, {most_lines} lines"
    );
    wait::until(Duration::from_millis(1200), "only the last generation, within two cycles or so", || async {
        (member_labels(&metrics().await?) == ids).then_some(())
    })
    .await;
    let page = metrics().await.unwrap_or_default();
    assert!(page.contains("reason=\"unreachable\""), "the dead pods' errors are on the page: {page}");
    drop(pods);
    let log = run.log();
    assert!(log.contains("not a member name"), "the hostile address is refused: {log}");
    eprintln!("churned {g} generations ({} members), at most {most} members and {most_lines} member lines on a page", g * 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_follow_the_ready_pods_of_an_inference_pool() {
    let kube = FakeKube::start(&["t"]).await;
    // Every pod of a pool serves on the pool's target port: three pods on three loopback
    // addresses, one metrics page each.
    let page = llm_lc_testkit::metrics_target::vllm_text(0.0, 1.0, 0.1);
    let first = MetricsTarget::start_at(([127, 0, 0, 2], 0).into(), &page).await.expect("bind 127.0.0.2");
    let port = first.addr.port();
    let mut _targets = vec![first];
    for last in [3, 4] {
        let at = ([127, 0, 0, last], port).into();
        _targets.push(
            MetricsTarget::start_at(at, &page).await.expect("the same port on another loopback address"),
        );
    }
    let sel = [("app", "vllm"), ("model", "llama")];
    kube.put_inference_pool(NS, "llama", &sel, &[port]);
    kube.put_pod(NS, "a", &sel, "127.0.0.2", "w1", true, false);
    kube.put_pod(NS, "b", &sel, "127.0.0.3", "w2", false, false);
    kube.put_pod(NS, "c", &[("app", "vllm"), ("model", "other")], "127.0.0.4", "w3", true, false);
    let run = Running::start_with(&format!(
        "inference_pool: llama, namespace: {NS}, api_url: '{}', token: {{ value: t }}",
        kube.url()
    ));
    let member = |ip: &str| format!("{ip}:{port}");
    let want = |ips: &[&str]| ips.iter().map(|ip| member(ip)).collect::<BTreeSet<_>>();
    run.wait_members(&want(&["127.0.0.2"]), "the one ready pod of the pool's selector").await;
    // A pod turns ready, another pod is relabelled into the pool: both join; the first starts
    // terminating: it leaves before it stops serving.
    kube.put_pod(NS, "b", &sel, "127.0.0.3", "w2", true, false);
    kube.put_pod(NS, "c", &sel, "127.0.0.4", "w3", true, false);
    run.wait_members(&want(&["127.0.0.2", "127.0.0.3", "127.0.0.4"]), "three ready pods").await;
    kube.put_pod(NS, "a", &sel, "127.0.0.2", "w1", true, true);
    run.wait_members(&want(&["127.0.0.3", "127.0.0.4"]), "the terminating pod left").await;
    // The pool's selector is emptied (it would select every pod): discovery fails, the last
    // members are kept, and the log says why.
    kube.put_inference_pool(NS, "llama", &[], &[port]);
    wait::until(Duration::from_secs(20), "the empty selector reported", || async {
        run.log().contains("matchLabels is empty").then_some(())
    })
    .await;
    assert_eq!(run.members().await, Some(want(&["127.0.0.3", "127.0.0.4"])), "{}", run.log());
    assert!(kube.errors().is_empty(), "the client sent nothing the API server refused: {:?}", kube.errors());
}

#[test]
fn the_inference_pool_rbac_grants_what_its_example_config_needs_and_no_writes() {
    let (k, role, rb) = example_and_rbac(
        "config/openshift-inference-pool-members.yaml",
        "deploy/openshift/inference-pool-members/rbac.yaml",
    );
    assert!(k.inference_pool.is_some() && k.service.is_none());
    let ns = k.namespace.expect("the example names its namespace");
    assert_eq!(role.metadata.namespace.as_deref(), Some(ns.as_str()));
    assert_eq!(rb.metadata.namespace.as_deref(), Some(ns.as_str()));
    let rules = role.rules.expect("rules");
    let grants = |group: &str, resource: &str, verb: &str| {
        rules.iter().any(|r| {
            r.api_groups.as_deref().is_some_and(|g| g.iter().any(|x| x == group))
                && r.resources.as_deref().is_some_and(|x| x.iter().any(|x| x == resource))
                && r.verbs.iter().any(|v| v == verb)
        })
    };
    assert!(grants("inference.networking.k8s.io", "inferencepools", "get"), "the controller gets the pool");
    assert!(grants("", "pods", "list"), "and lists its pods");
    assert_eq!(rules.len(), 2, "nothing else");
    assert!(
        rules.iter().flat_map(|r| &r.verbs).all(|v| ["get", "list", "watch"].contains(&v.as_str())),
        "read-only"
    );
    assert_eq!(rb.role_ref.name, role.metadata.name.unwrap_or_default());
}
