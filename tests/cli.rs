//! The command line as an operator meets it, on the built binary: quick-start flags next to
//! `--config` (refused) and top-level flags (override the file), `LLMLC_*` environment fallbacks,
//! `check`'s plan as YAML, JSON logs with `message` at the top level, `--once` without a listener,
//! and a sink warning logged once.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use llm_lc_testkit::bigip::{BigIpDouble, DoubleConfig, MemberSpec, PoolSpec, Role, UserSpec};
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::{ports, wait};

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

/// The binary with no `LLMLC_*` variable of the caller's environment leaking in.
fn cmd() -> Command {
    let mut c = Command::new(BIN);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("LLMLC_") {
            c.env_remove(&k);
        }
    }
    c.env_remove("KUBERNETES_SERVICE_HOST").env_remove("KUBERNETES_SERVICE_PORT").env_remove("RUST_LOG");
    c
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn write_config(dir: &Path, body: &str) -> PathBuf {
    let p = dir.join("c.yaml");
    std::fs::write(&p, body).expect("write config");
    p
}

fn scrape_config(listen: &str, member: &str) -> String {
    format!(
        "interval: 1s\nlisten: {listen}\nsources:\n  direct: {{ kind: scrape }}\npools:\n  - name: llm\n    source: direct\n    members: {{ static: ['{member}'] }}\n"
    )
}

#[test]
fn quick_start_flags_with_config_are_refused_naming_the_flag_and_the_field() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = write_config(dir.path(), &scrape_config("127.0.0.1:0", "127.0.0.1:9"));
    let out = cmd()
        .args(["run", "--once", "--config"])
        .arg(&cfg)
        .args(["--profile", "sglang"])
        .output()
        .expect("run");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--profile (LLMLC_PROFILE) only build the quick-start pool"), "{err}");
    assert!(err.contains("`profile:` on the pool"), "{err}");
    assert!(err.contains("c.yaml"), "{err}");

    // The same through the environment: a leftover LLMLC_SCRAPE is not silently ignored either.
    let out = cmd()
        .args(["run", "--once", "--config"])
        .arg(&cfg)
        .env("LLMLC_SCRAPE", "10.0.0.1:8000")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--scrape (LLMLC_SCRAPE)"), "{}", stderr(&out));

    // A leftover LLMLC_SELECTOR too, with the refusal (not clap's "--prometheus is required").
    let out = cmd()
        .args(["run", "--once", "--config"])
        .arg(&cfg)
        .env("LLMLC_SELECTOR", "{job=\"vllm\"}")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--selector (LLMLC_SELECTOR) only build"), "{}", stderr(&out));
    // Without --config, a selector alone says what it lacks.
    let out = cmd().args(["run", "--once", "--selector", "{job=\"vllm\"}"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("needs --prometheus"), "{}", stderr(&out));
}

/// The controller as a child process, killed on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn get(port: u16, path: &str) -> Option<String> {
    let r = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{port}{path}"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    r.status().is_success().then_some(())?;
    r.text().await.ok()
}

/// Control cycles run so far, summed over results, from the controller's `/metrics`.
async fn cycles(port: u16) -> Option<u64> {
    let text = get(port, "/metrics").await?;
    let n = text
        .lines()
        .filter(|l| l.starts_with("llmlc_cycles_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    Some(n as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_and_interval_from_the_environment_override_the_file() {
    let target = MetricsTarget::vllm(1.0, 4.0, 0.2).await;
    let dir = tempfile::tempdir().expect("tmp");
    // The file says port 1 (never bindable here) and 1 s; the environment says otherwise.
    let cfg = write_config(dir.path(), &scrape_config("127.0.0.1:1", &target.member()));
    let port = ports::free_port();
    let log = dir.path().join("stderr.log");
    let _run = Running(
        cmd()
            .args(["run"])
            .env("LLMLC_CONFIG", &cfg)
            .env("LLMLC_LISTEN", format!("127.0.0.1:{port}"))
            .env("LLMLC_INTERVAL", "250ms")
            .env("LLMLC_LOG_FORMAT", "json")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("start"),
    );
    // Served on the environment's port, cycling at its interval (the start line says which).
    wait::until(Duration::from_secs(20), "the controller on LLMLC_LISTEN", || async {
        cycles(port).await.filter(|&n| n >= 1)
    })
    .await;
    let json_lines = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .collect()
    };
    let start_line = json_lines()
        .into_iter()
        .find(|v| v["message"] == "controller started")
        .unwrap_or_else(|| panic!("no JSON `controller started` line"));
    assert_eq!(start_line["listen"], format!("127.0.0.1:{port}"), "{start_line}");
    assert_eq!(start_line["interval"], "250ms", "{start_line}");

    // A live reload of the file (which says 1s, and now 2s) keeps the environment's interval.
    std::fs::write(
        &cfg,
        scrape_config("127.0.0.1:1", &target.member()).replace("interval: 1s", "interval: 2s"),
    )
    .expect("rewrite");
    let reloaded = wait::until(Duration::from_secs(15), "the reload", || async {
        json_lines().into_iter().find(|v| v["message"] == "config reloaded")
    })
    .await;
    assert_eq!(reloaded["interval"], "250ms", "{reloaded}");
    // Still serving where the environment said, not on the file's port.
    assert!(cycles(port).await.is_some(), "listener gone after the reload");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_fallbacks_drive_a_quick_start_and_json_logs_have_message_on_top() {
    let target = MetricsTarget::vllm(1.0, 4.0, 0.2).await;
    let out = cmd()
        .args(["run", "--once"])
        .env("LLMLC_SCRAPE", target.member())
        .env("LLMLC_DRY_RUN", "true")
        .env("LLMLC_OUTPUT", "json")
        .env("LLMLC_LOG_FORMAT", "json")
        .env("LLMLC_PROFILE", "vllm")
        .output()
        .expect("run");
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("stdout is not one JSON report ({e})"));
    assert_eq!(report["pools"][0]["members"][0]["member"], target.member(), "{report}");
    // Every stderr line is a JSON object with the message at the top level, never under `fields`.
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty(), "no log lines");
    for l in &lines {
        assert!(l["message"].is_string(), "no top-level message: {l}");
        assert!(l.get("fields").is_none(), "nested fields: {l}");
        assert!(l["level"].is_string(), "{l}");
    }
    let started = lines.iter().find(|l| l["message"] == "controller started").expect("start line");
    assert_eq!(started["dry_run"], true, "LLMLC_DRY_RUN=true: {started}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_needs_no_listener_even_when_its_port_is_taken() {
    let target = MetricsTarget::vllm(1.0, 4.0, 0.2).await;
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = write_config(dir.path(), &scrape_config(&format!("127.0.0.1:{port}"), &target.member()));
    let out = cmd().args(["run", "--once", "--dry-run", "--config"]).arg(&cfg).output().expect("run");
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("cannot listen"), "{err}");
    // The quick start too, on the same taken port.
    let out = cmd()
        .args([
            "run",
            "--once",
            "--dry-run",
            "--scrape",
            &target.member(),
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .output()
        .expect("run");
    assert!(out.status.success(), "{}", stderr(&out));
    drop(taken);
}

#[test]
fn check_prints_the_plan_as_yaml_without_rust_debug_output() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = write_config(
        dir.path(),
        "sources:\n  direct: { kind: scrape }\npools:\n  - name: llm\n    source: direct\n    profile: vllm-legacy\n    members: { static: ['10.0.0.1:8000'] }\n    policy: { kind: feedback, gain: 0.1 }\n    sink: { kind: haproxy, address: '127.0.0.1:9999', backend: llm, password_is_not_a_field: 1 }\n",
    );
    // An unknown field still fails with its line, before any plan is printed.
    let out = cmd().args(["check", "--config"]).arg(&cfg).output().expect("check");
    assert_eq!(out.status.code(), Some(2));
    // (serde reports an internally tagged section's unknown field at the start of its pool.)
    let err = stderr(&out);
    assert!(
        err.contains("c.yaml:4:") && err.contains("pools[0].sink") && err.contains("password_is_not_a_field"),
        "{err}"
    );

    let text = std::fs::read_to_string(&cfg).expect("read").replace(", password_is_not_a_field: 1", "");
    std::fs::write(&cfg, text).expect("write");
    let out = cmd().args(["check"]).env("LLMLC_CONFIG", &cfg).output().expect("check");
    assert!(out.status.success(), "{}", stderr(&out));
    let plan = String::from_utf8_lossy(&out.stdout);
    for debug in ["Feedback(", "Params {", "Some(", "None", "HaproxyConfig", "RuntimeApi"] {
        assert!(!plan.contains(debug), "Rust Debug output {debug:?} in the plan:\n{plan}");
    }
    assert!(plan.starts_with("# config OK"), "{plan}");
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&plan).expect("the plan is YAML");
    let pool = &doc["pools"][0];
    assert_eq!(pool["profile"].as_str(), Some("vllm-legacy"), "{plan}");
    assert_eq!(pool["policy"]["kind"].as_str(), Some("feedback"), "{plan}");
    assert_eq!(pool["policy"]["gain"].as_f64(), Some(0.1), "{plan}");
    assert_eq!(pool["sink"]["mode"].as_str(), Some("runtime-api"), "{plan}");
    assert_eq!(pool["sink"]["backend"].as_str(), Some("llm"), "{plan}");
    assert_eq!(pool["metrics"]["kv_usage"][0].as_str(), Some("vllm:gpu_cache_usage_perc"), "{plan}");
    assert_eq!(doc["interval"].as_str(), Some("5s"), "{plan}");
    // A boolean any YAML reader agrees on (`on` would be true to YAML 1.1 readers, a string to 1.2).
    assert_eq!(doc["sources"]["direct"]["tls_verify"].as_bool(), Some(true), "{plan}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_in_a_mode_that_ignores_ratios_is_warned_about_once() {
    let target = MetricsTarget::vllm(1.0, 4.0, 0.2).await;
    let d = BigIpDouble::start_with(DoubleConfig::default()).await;
    d.add_user(UserSpec::new("svc-llm", "pw-123", Role::ApplicationEditor));
    d.add_pool(
        PoolSpec::new("/Common/llm_pool")
            .mode("round-robin")
            .member(MemberSpec::ip("127.0.0.1", target.addr.port())),
    );
    let dir = tempfile::tempdir().expect("tmp");
    let port = ports::free_port();
    let cfg = write_config(
        dir.path(),
        &format!(
            "interval: 200ms\nlisten: 127.0.0.1:{port}\nsources:\n  direct: {{ kind: scrape }}\npools:\n  - name: llm\n    source: direct\n    members: {{ from_lb: true }}\n    sink: {{ kind: f5, url: '{}', pool: /Common/llm_pool, username: svc-llm, password: {{ value: pw-123 }} }}\n",
            d.url()
        ),
    );
    let log = dir.path().join("stderr.log");
    let _run = Running(
        cmd()
            .args(["run", "--config"])
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("start"),
    );
    // Several pushes later (each reads the pool's mode again), the warning is in the log once.
    wait::until(Duration::from_secs(20), "five cycles", || async { cycles(port).await.filter(|&n| n >= 5) })
        .await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let n = text.matches("in which member ratios have no effect").count();
    assert_eq!(n, 1, "the mode warning should be logged exactly once:\n{text}");
}
