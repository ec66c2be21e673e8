//! `check` refuses what `run` would refuse or quietly mishandle, with exit code 2 and a message naming
//! the field; and it never prints credentials from URLs.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

fn check(dir: &Path, text: &str) -> std::process::Output {
    let p = dir.join("c.yaml");
    std::fs::write(&p, text).expect("write config");
    Command::new(BIN).args(["check", "--config"]).arg(&p).output().expect("run check")
}

/// A valid config with a Prometheus source and one static pool; cases replace one piece.
fn base(source_extra: &str, pool_extra: &str, members: &str) -> String {
    format!(
        "interval: 5s\nsources:\n  prom:\n    kind: prometheus\n    url: http://prometheus:9090\n{source_extra}  direct: {{ kind: scrape }}\npools:\n  - name: p\n    source: prom\n    members: {{ static: [{members}] }}\n{pool_extra}"
    )
}

const MEMBERS: &str = "'10.0.0.1:8000', '10.0.0.2:8000'";

#[test]
fn the_base_config_passes() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = check(dir.path(), &base("", "", MEMBERS));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn each_bad_case_exits_2_naming_its_field() {
    let dir = tempfile::tempdir().expect("tmp");
    let not_pem = dir.path().join("not-a-ca.pem");
    std::fs::write(&not_pem, "hello\n").expect("write");
    let missing = dir.path().join("missing-ca.crt");
    let cases: Vec<(&str, String, &str)> = vec![
        ("interval 1ns", base("", "", MEMBERS).replace("interval: 5s", "interval: 1ns"), "interval:"),
        ("interval 2h", base("", "", MEMBERS).replace("interval: 5s", "interval: 2h"), "interval:"),
        (
            "interval far too large",
            base("", "", MEMBERS).replace("interval: 5s", "interval: 500000000years"),
            "interval",
        ),
        ("header name", base("    headers: { 'X Bad': v }\n", "", MEMBERS), "sources.prom.headers.X Bad:"),
        (
            "header value newline",
            base("    headers: { X-Scope-OrgID: \"a\\r\\nInjected: 1\" }\n", "", MEMBERS),
            "sources.prom.headers.X-Scope-OrgID:",
        ),
        (
            "missing ca_file",
            base(&format!("    ca_file: {}\n", missing.display()), "", MEMBERS),
            "sources.prom.ca_file:",
        ),
        (
            "ca_file not PEM",
            base(&format!("    ca_file: {}\n", not_pem.display()), "", MEMBERS),
            "sources.prom.ca_file:",
        ),
        ("timeout 0", base("    timeout: 0s\n", "", MEMBERS), "sources.prom.timeout:"),
        (
            "member as URL",
            base("", "", "'http://10.0.0.1:8000', '10.0.0.2:8000'"),
            "pools[0].members.static[0]:",
        ),
        (
            "member with credentials",
            base("", "", "'user:pw@10.0.0.1:8000', '10.0.0.2:8000'"),
            "pools[0].members.static[0]:",
        ),
        ("member with path", base("", "", "'10.0.0.1:8000/metrics'"), "pools[0].members.static[0]:"),
        (
            "selector with PromQL",
            base("", "    selector: 'job=\"vllm\"} or vector(1) or up{'\n", MEMBERS),
            "pools[0].selector:",
        ),
        ("selector unquoted", base("", "    selector: 'job=vllm'\n", MEMBERS), "pools[0].selector:"),
        ("selector bad regex", base("", "    selector: 'job=~\"(\"'\n", MEMBERS), "pools[0].selector:"),
        ("stale_after 0", base("", "    stale_after: 0s\n", MEMBERS), "pools[0].stale_after:"),
        ("grace 30 days", base("", "    grace: 30days\n", MEMBERS), "pools[0].grace:"),
        ("reset_after 100 days", base("", "    reset_after: 100days\n", MEMBERS), "pools[0].reset_after:"),
        (
            "queue_norm tiny",
            base("", "    policy: { kind: headroom, queue_norm: 1e-300 }\n", MEMBERS),
            "pools[0].policy.queue_norm:",
        ),
        (
            "queue_norm tiny (feedback)",
            base("", "    policy: { kind: feedback, queue_norm: 1e-9 }\n", MEMBERS),
            "pools[0].policy.queue_norm:",
        ),
        (
            "scrape max_body_bytes",
            base("", "", MEMBERS)
                .replace("direct: { kind: scrape }", "direct: { kind: scrape, max_body_bytes: 10 }"),
            "sources.direct.max_body_bytes:",
        ),
        (
            "prometheus_up selector",
            base("", "", MEMBERS)
                .replace(&format!("static: [{MEMBERS}]"), "prometheus_up: '{job=\"vllm\"} or vector(1)'"),
            "pools[0].members.prometheus_up:",
        ),
    ];
    let mut failures = Vec::new();
    for (name, text, field) in &cases {
        let out = check(dir.path(), text);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.code() != Some(2) || !stderr.contains(field) {
            failures.push(format!(
                "{name}: exit {:?}, expected 2 naming {field:?}; stderr: {stderr}",
                out.status.code()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn check_prints_urls_without_credentials() {
    let dir = tempfile::tempdir().expect("tmp");
    let text =
        base("", "    sink: { kind: webhook, url: 'https://hook:hooksecret@hooks.example/x' }\n", MEMBERS)
            .replace("http://prometheus:9090", "https://reader:s3cret@thanos:9092/?namespace=llm");
    let out = check(dir.path(), &text);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("thanos:9092") && stdout.contains("namespace=llm"), "{stdout}");
    assert!(!stdout.contains("s3cret") && !stdout.contains("hooksecret"), "{stdout}");
}

/// A valid CA bundle passes (the check reads the file the way `run` does).
#[test]
fn an_existing_pem_ca_file_passes() {
    let dir = tempfile::tempdir().expect("tmp");
    let key = dir.path().join("ca.key");
    let crt = dir.path().join("ca.crt");
    let status = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=test-ca",
            "-keyout",
        ])
        .arg(&key)
        .arg("-out")
        .arg(&crt)
        .output()
        .expect("openssl");
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    let out = check(dir.path(), &base(&format!("    ca_file: {}\n", crt.display()), "", MEMBERS));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// F5 documents member ratio as 1..100; a pool that could ask for more is refused with the reason,
/// unless the sink opts in to a larger `max_ratio`.
#[test]
fn an_f5_pool_above_ratio_100_is_refused_unless_the_sink_opts_in() {
    let dir = tempfile::tempdir().expect("tmp");
    let f5 = |extra: &str| {
        base(
            "",
            &format!(
                "    ratio: {{ min: 1, max: 1000 }}\n    sink: {{ kind: f5, url: 'https://bigip.example.com', pool: /Common/p, username: u, password: {{ value: x }}{extra} }}\n"
            ),
            MEMBERS,
        )
    };
    let out = check(dir.path(), &f5(""));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("pools[0].ratio.max") && err.contains("1..100") && err.contains("max_ratio"),
        "{err}"
    );
    let out = check(dir.path(), &f5(", max_ratio: 1000"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn slot_counts_are_checked_and_check_names_llamacpp_members_without_one() {
    let dir = tempfile::tempdir().expect("tmp");
    // 0 and absurd counts are refused with the member named.
    for (slots, says) in [
        ("    slots: { default: 0 }\n", "pools[0].slots.default"),
        ("    slots: { members: { '10.0.0.2:8000': 100000000 } }\n", "10.0.0.2:8000"),
    ] {
        let out = check(dir.path(), &base("", &format!("    profile: llamacpp\n{slots}"), MEMBERS));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{slots}: {err}");
        assert!(err.contains(says) && err.contains("must be 1..="), "{slots}: {err}");
    }
    // Through Prometheus, a member without a count is named in the plan.
    let out = check(
        dir.path(),
        &base("", "    profile: llamacpp\n    slots: { members: { '10.0.0.1:8000': 4 } }\n", MEMBERS),
    );
    let plan = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lacking = plan.split("without_slots:").nth(1).unwrap_or_default();
    let lacking: Vec<&str> =
        lacking.lines().skip(1).take_while(|l| l.trim_start().starts_with("- ")).collect();
    assert_eq!(lacking.iter().map(|l| l.trim()).collect::<Vec<_>>(), ["- 10.0.0.2:8000"], "{plan}");
    // By scrape the servers say it themselves (GET /props): nothing lacks.
    let out = check(
        dir.path(),
        &base("", "    profile: llamacpp\n", MEMBERS).replace("    source: prom\n", "    source: direct\n"),
    );
    let plan = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && plan.contains("GET /props") && !plan.contains("without_slots"), "{plan}");
}
