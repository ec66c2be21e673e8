//! The controller's status page at `/`, loaded in a real headless browser (Debian's `chromium`,
//! installed by tests/run.sh): the page renders one table per pool with a row per member, charts of
//! the last cycles, refreshes itself without a reload, and logs nothing to the console. The
//! browser's console is read from its own log (`--enable-logging=stderr`: every console message is
//! an `INFO:CONSOLE` line); a page with deliberate errors proves that capture works.

mod leader_support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use leader_support::Proc;
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::{ports, wait};
use llm_load_controller::report::{CycleReport, MemberReport, PoolReport};
use llm_load_controller::telemetry::Telemetry;
use regex::Regex;

/// What the browser made of a page: the DOM after its scripts ran, and its console messages.
struct Loaded {
    dom: String,
    console: Vec<String>,
}

/// `chromium --headless --dump-dom` with `budget` of virtual time: timers run as fast as the page
/// lets them, the clock waits for pending fetches, so several refreshes fit in a second of real time.
fn load(url: &str, budget: Duration) -> Loaded {
    let profile = tempfile::tempdir().expect("profile dir");
    let log = profile.path().join("stderr.log");
    let out = profile.path().join("dom.html");
    let mut child = Command::new("chromium")
        .args([
            "--headless",
            // Root in a container has no user namespaces for Chromium's sandbox.
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--virtual-time-budget={}", budget.as_millis()))
        .args(["--dump-dom", url])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("dom file"))
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start chromium ({e}); tests/run.sh installs Debian's chromium"));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let stderr = std::fs::read_to_string(&log).unwrap_or_default();
                assert!(status.success(), "chromium failed: {status}\n{stderr}");
                let console = stderr.lines().filter(|l| l.contains(":CONSOLE")).map(str::to_string).collect();
                let dom = std::fs::read_to_string(&out).expect("read the DOM");
                return Loaded { dom, console };
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("chromium did not finish within 60 s loading {url}");
            }
        }
    }
}

fn element_text<'a>(dom: &'a str, id: &str) -> &'a str {
    let re = Regex::new(&format!(r#"id="{id}"[^>]*>([^<]*)<"#)).expect("regex");
    re.captures(dom)
        .and_then(|c| c.get(1))
        .map(|m| m.as_str())
        .unwrap_or_else(|| panic!("no #{id} in the DOM"))
}

/// (member, weight cell, polylines in its weight chart, points of its longest weight line) per row.
fn member_rows(dom: &str) -> Vec<(String, String, usize, usize)> {
    let row = Regex::new(r#"(?s)<tr class="member-row" data-member="([^"]+)">(.*?)</tr>"#).expect("regex");
    let weight = Regex::new(r#"<td class="weight">([^<]*)</td>"#).expect("regex");
    let chart = Regex::new(r#"(?s)<svg class="spark weight"[^>]*>(.*?)</svg>"#).expect("regex");
    let line = Regex::new(r#"<polyline points="([^"]*)""#).expect("regex");
    row.captures_iter(dom)
        .map(|c| {
            let body = &c[2];
            let w = weight.captures(body).map(|w| w[1].to_string()).unwrap_or_default();
            let svg = chart.captures(body).map(|s| s[1].to_string()).unwrap_or_default();
            let lines: Vec<usize> =
                line.captures_iter(&svg).map(|l| l[1].split_whitespace().count()).collect();
            (c[1].to_string(), w, lines.len(), lines.into_iter().max().unwrap_or(0))
        })
        .collect()
}

fn refreshes(dom: &str) -> u32 {
    let re = Regex::new(r#"<body data-refreshes="(\d+)""#).expect("regex");
    re.captures(dom).and_then(|c| c[1].parse().ok()).expect("data-refreshes on <body>")
}

#[test]
fn console_capture_sees_errors_of_a_broken_page() {
    let dir = tempfile::tempdir().expect("tmp");
    let page = dir.path().join("broken.html");
    std::fs::write(
        &page,
        "<!doctype html><body><script>console.error('deliberate'); notAFunction();</script></body>",
    )
    .expect("write");
    let l = load(&format!("file://{}", page.display()), Duration::from_millis(500));
    assert!(l.console.iter().any(|c| c.contains("deliberate")), "{:?}", l.console);
    assert!(l.console.iter().any(|c| c.contains("Uncaught ReferenceError")), "{:?}", l.console);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_page_renders_live_tables_and_charts_of_a_running_controller() {
    // Two servers, one idle and one loaded: the loaded one must show the lower weight.
    let idle = MetricsTarget::vllm(0.0, 2.0, 0.1).await;
    let busy = MetricsTarget::vllm(12.0, 60.0, 0.9).await;
    let tmp = tempfile::tempdir().expect("tmp");
    let listen = ports::free_port();
    let cfg = tmp.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "interval: 300ms\nlisten: 127.0.0.1:{listen}\nsources:\n  direct: {{ kind: scrape }}\n\
             pools:\n  - name: llm\n    source: direct\n    members: {{ static: ['{}', '{}'] }}\n",
            idle.member(),
            busy.member()
        ),
    )
    .expect("config");
    let p = Proc::start(&cfg, listen, &[], &tmp.path().join("log"));
    wait::http_ok(&format!("http://127.0.0.1:{listen}/readyz"), Duration::from_secs(10)).await;
    // A few cycles of history, so the charts have lines to draw.
    wait::until(Duration::from_secs(10), "5 cycles of history", || async {
        let (_, body) = p.get("/v1/history").await?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        (v["cycles"].as_u64()? >= 5).then_some(())
    })
    .await;

    let url = format!("http://127.0.0.1:{listen}/");
    let l = tokio::task::spawn_blocking(move || load(&url, Duration::from_secs(4))).await.expect("join");

    assert!(l.console.is_empty(), "console messages: {:#?}", l.console);
    assert_eq!(element_text(&l.dom, "errors"), "", "the page reported an error");
    assert!(element_text(&l.dom, "ready").starts_with("ready: "), "{}", element_text(&l.dom, "ready"));
    assert!(l.dom.contains(r#"<section class="pool" data-pool="llm">"#), "no table for pool llm");
    assert!(l.dom.contains("push: "), "no push outcome shown");
    let rows = member_rows(&l.dom);
    assert_eq!(rows.len(), 2, "one row per member: {rows:?}");
    let weight_of = |m: &str| -> u32 {
        let (_, w, _, _) = rows.iter().find(|r| r.0 == m).unwrap_or_else(|| panic!("no row for {m}"));
        // "old → new" while the weight moves, else "new".
        w.rsplit(' ').next().and_then(|x| x.parse().ok()).unwrap_or_else(|| panic!("weight cell {w:?}"))
    };
    assert!(
        weight_of(&busy.member()) < weight_of(&idle.member()),
        "the loaded member should have the lower weight: {rows:?}"
    );
    for (m, _, lines, points) in &rows {
        assert!(*lines >= 1 && *points >= 5, "{m}: weight chart has {lines} lines, longest {points} points");
    }
    // Refreshed in place several times (each refresh counts in JavaScript; a reload would reset it).
    assert!(refreshes(&l.dom) >= 2, "refreshes: {}", refreshes(&l.dom));
    assert!(l.dom.contains("sample age"), "sample age column");
    drop(p);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_the_first_cycle_the_page_says_so_without_errors_then_shows_the_cycle() {
    let t = Telemetry::new(Duration::from_millis(200), 3);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = t.router();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let url = format!("http://{addr}/");

    // Not ready, no cycle: the page waits quietly (v1/ratios would answer 503, so it is not asked).
    let u = url.clone();
    let l = tokio::task::spawn_blocking(move || load(&u, Duration::from_millis(1500))).await.expect("join");
    assert!(l.console.is_empty(), "console messages: {:#?}", l.console);
    assert_eq!(element_text(&l.dom, "errors"), "");
    assert!(element_text(&l.dom, "ready").starts_with("not ready: no good cycle yet"), "{}", l.dom);
    assert!(l.dom.contains("waiting for the first cycle"));

    // One cycle with a member that has no data: the row says so, its chart is empty but present.
    let report = CycleReport {
        ts: "2026-01-01T00:00:00Z".into(),
        pools: vec![PoolReport {
            pool: "p<1>".into(),
            state: llm_load_controller::cycle::PoolState::Ok,
            policy: "feedback",
            sink: "dry-run",
            push: llm_load_controller::cycle::PushOutcome::DryRun,
            saturation: Some(0.25),
            members: vec![
                MemberReport {
                    member: "10.0.0.1:8000".into(),
                    ratio: 40,
                    old_ratio: Some(50),
                    waiting: Some(3.0),
                    running: Some(9.0),
                    kv_usage: Some(0.5),
                    latency_s: Some(0.02),
                    service_s: Some(0.015),
                    age_s: Some(1.5),
                    ..Default::default()
                },
                MemberReport { member: "10.0.0.2:8000".into(), ratio: 50, ..Default::default() },
            ],
            ..Default::default()
        }],
    };
    t.record(report, true);
    let Loaded { dom, console } =
        tokio::task::spawn_blocking(move || load(&url, Duration::from_millis(1500))).await.expect("join");
    assert!(console.is_empty(), "console messages: {console:#?}");
    assert_eq!(element_text(&dom, "errors"), "");
    // The pool name is text, not markup.
    assert!(dom.contains(r#"data-pool="p<1>""#) || dom.contains(r#"data-pool="p&lt;1&gt;""#), "{dom}");
    assert!(dom.contains("pool p&lt;1&gt;"), "pool name escaped in the heading");
    let rows = member_rows(&dom);
    assert_eq!(
        rows.iter().map(|r| (r.0.as_str(), r.1.as_str())).collect::<Vec<_>>(),
        [("10.0.0.1:8000", "50 → 40"), ("10.0.0.2:8000", "50")]
    );
    assert!(dom.contains("no data"), "a member without a sample says so");
    assert!(dom.contains(r#"<td class="service">15 ms</td>"#), "the time running is shown");
    assert!(dom.contains(r#"<td class="service">-</td>"#), "and a dash where there is none");
    assert!(dom.contains("saturation 25%"));
    server.abort();
}

#[test]
fn the_page_is_self_contained() {
    // Disconnected clusters: nothing may come from another origin.
    let page =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/telemetry/status.html"))
            .expect("read the page");
    for bad in ["http://", "https://", "//cdn", "<link "] {
        let hits: Vec<&str> =
            page.lines().filter(|l| l.contains(bad) && !l.contains("http://www.w3.org/2000/svg")).collect();
        assert!(hits.is_empty(), "external reference {bad}: {hits:?}");
    }
}
