//! Every example in config/ passes `check`, and typical mistakes fail it with exit code 2 and a
//! message naming the file and field.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

fn check(path: &Path) -> std::process::Output {
    Command::new(BIN).args(["check", "--config"]).arg(path).output().expect("run check")
}

/// `check` of an example written for a pod: its mounted files (CA bundles) do not exist here.
fn check_elsewhere(path: &Path) -> std::process::Output {
    Command::new(BIN).args(["check", "--offline", "--config"]).arg(path).output().expect("run check")
}

#[test]
fn every_example_in_config_passes_check() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("config/ exists") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") || is_not_controller_config(&path) {
            continue;
        }
        let out = check_elsewhere(&path);
        assert!(
            out.status.success(),
            "{} failed check:\n{}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("config OK"), "{}", path.display());
        n += 1;
    }
    assert!(n >= 3, "expected at least three controller configs in config/, found {n}");
}

/// The shipped OpenShift config names the pod's mounted CA bundle and Secrets: plain `check` on a
/// laptop names the file it cannot read; `check --offline` passes, reads none of them, and lists
/// each as not verified, with the field; its plan is plain `check`'s plus comments.
#[test]
fn offline_check_passes_a_pod_config_here_and_lists_what_it_took_on_trust() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/openshift-bigip.yaml");
    let plain = check(&path);
    let err = String::from_utf8_lossy(&plain.stderr);
    if !Path::new("/etc/llm-load-controller/service-ca/service-ca.crt").exists() {
        assert_eq!(plain.status.code(), Some(2), "{err}");
        assert!(
            err.contains(
                "sources.thanos.ca_file: cannot read /etc/llm-load-controller/service-ca/service-ca.crt"
            ),
            "{err}"
        );
    }
    let off = check_elsewhere(&path);
    let out = String::from_utf8_lossy(&off.stdout);
    assert!(off.status.success(), "{}", String::from_utf8_lossy(&off.stderr));
    for line in [
        "#   sources.thanos.ca_file: CA bundle /etc/llm-load-controller/service-ca/service-ca.crt (not read)",
        "#   sources.thanos.bearer_token.file: secret file /var/run/secrets/kubernetes.io/serviceaccount/token (not read)",
        "#   sources.thanos.url: https://thanos-querier.openshift-monitoring.svc:9091 (not reached)",
    ] {
        assert!(out.lines().any(|l| l == line), "{line:?} missing from\n{out}");
    }
    let plan = |text: &str| -> String {
        text.lines().filter(|l| !l.starts_with('#')).map(|l| format!("{l}\n")).collect()
    };
    let with_files = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&path)
        .env("LLMLC_SKIP_FILE_CHECKS", "1")
        .output()
        .expect("run check");
    assert_eq!(plan(&out), plan(&String::from_utf8_lossy(&with_files.stdout)), "the same plan");
}

/// Routing tables for the reference proxy live in config/ too; they are checked by the proxy's tests.
fn is_not_controller_config(path: &Path) -> bool {
    std::fs::read_to_string(path).map(|t| t.lines().any(|l| l.starts_with("# proxy config"))).unwrap_or(false)
}

fn write(dir: &Path, text: &str) -> std::path::PathBuf {
    let p = dir.join("bad.yaml");
    std::fs::write(&p, text).expect("write");
    p
}

#[test]
fn misspelt_field_exits_2_naming_file_line_and_field() {
    let dir = tempfile::tempdir().expect("tmp");
    let p = write(
        dir.path(),
        "sources:\n  s: { kind: scrape }\npools:\n  - name: p\n    source: s\n    members: { static: ['a:1'] }\n    polcy: { kind: feedback }\n",
    );
    let out = check(&p);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.yaml:7:"), "{err}");
    assert!(err.contains("pools[0]") && err.contains("polcy"), "{err}");
}

#[test]
fn negative_interval_exits_2_naming_the_field() {
    let dir = tempfile::tempdir().expect("tmp");
    let p = write(dir.path(), "interval: -5s\nsources:\n  s: { kind: scrape }\npools:\n  - name: p\n    source: s\n    members: { static: ['a:1'] }\n");
    let out = check(&p);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.yaml:1:") && err.contains("interval"), "{err}");
}

#[test]
fn plan_shows_the_exact_promql() {
    let dir = tempfile::tempdir().expect("tmp");
    let p = write(
        dir.path(),
        "sources:\n  prom: { kind: prometheus, url: 'http://prom:9090' }\npools:\n  - name: p\n    source: prom\n    selector: 'job=\"vllm\"'\n    members: { prometheus_up: '{job=\"vllm\"}' }\n",
    );
    let out = check(&p);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plan = String::from_utf8_lossy(&out.stdout);
    assert!(plan.contains("sum by (instance) (vllm:num_requests_waiting{job=\"vllm\"})"), "{plan}");
    assert!(plan.contains("discovered_each_cycle_from: up{job=\"vllm\"}"), "{plan}");
}

/// Plain `check` connects to every address the config names and names each one it cannot reach,
/// without sending anything; `--offline` reaches nothing.
#[test]
fn plain_check_names_each_unreachable_thing_and_offline_reaches_nothing() {
    let prometheus = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let gone = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let (live, dead) = (prometheus.local_addr().expect("addr"), gone.local_addr().expect("addr"));
    drop(gone);
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "sources:\n  prom: {{kind: prometheus, url: 'http://{live}'}}\n  direct: {{kind: scrape}}\npools:\n  \
             - name: a\n    source: prom\n    members: {{static: ['10.9.0.1:8000']}}\n    \
             sink: {{kind: webhook, url: 'http://{dead}/admin/ratios'}}\n  \
             - name: b\n    source: direct\n    members: {{static: ['{live}', '{dead}']}}\n    \
             sink: {{kind: haproxy, address: 'unix:{}', backend: llm}}\n  \
             - name: c\n    source: prom\n    members: {{static: ['10.9.0.2:8000']}}\n    sink: {{kind: envoy, cluster: c}}\n",
            dir.path().join("no.sock").display()
        ),
    )
    .expect("config");
    let out = check(&cfg);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "a valid config exits 0: {}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("# reach: 2 of 5 reachable from here"), "{text}");
    assert!(text.contains(&format!("#   reachable    source prom {live}")), "{text}");
    assert!(text.contains(&format!("#   reachable    pool b: member {live}")), "{text}");
    assert!(text.contains(&format!("#   UNREACHABLE  pool a: sink webhook {dead}: ")), "{text}");
    assert!(text.contains(&format!("#   UNREACHABLE  pool b: member {dead}: ")), "{text}");
    assert!(text.contains("#   UNREACHABLE  pool b: sink haproxy unix:"), "{text}");
    assert!(text.contains("#   not probed   pool c: sink envoy"), "{text}");
    // Members of a Prometheus source are read through Prometheus, never connected to.
    assert!(!text.lines().any(|l| l.starts_with("#   ") && l.contains("10.9.0.")), "{text}");
    // The plan before the report still parses as YAML.
    serde_yaml_ng::from_str::<serde_yaml_ng::Value>(&text).expect("plan and report parse as YAML");

    let off = check_elsewhere(&cfg);
    let text = String::from_utf8_lossy(&off.stdout);
    assert!(off.status.success() && !text.contains("# reach:"), "--offline reaches nothing: {text}");
}

/// A pool's endpoint picker is in the plan: its doors, what it reads and how often, and every
/// setting in force (the ones the file leaves out at their defaults).
#[test]
fn the_plan_shows_the_pickers_doors_reads_and_settings() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/haproxy-spoe.yaml");
    let off = check_elsewhere(&path);
    let out = String::from_utf8_lossy(&off.stdout);
    assert!(off.status.success(), "{}", String::from_utf8_lossy(&off.stderr));
    for line in [
        "  picker:",
        "    spoe: 0.0.0.0:9005",
        "    reads: http://MEMBER/metrics every 100ms",
        "      affinity: 0.8",
        "      saturation_tokens: 20000.0",
    ] {
        assert!(out.lines().any(|l| l == line), "{line:?} missing from\n{out}");
    }
}
