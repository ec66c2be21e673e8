//! The real vLLM (0.32, the CPU build, `tests/vllm/`) in the loop, on the seed demo's own story:
//! two servers of one model, `--max-num-seqs 4` and `1`, behind a real HAProxy `balance leastconn`.
//! vLLM publishes no batch limit and a tiny model's KV usage is ~0.002, so nothing on the page says
//! the second server is a quarter of the first; what it does says so (it runs 1 while 2 wait). The
//! controller, with its defaults (`profile: vllm`, members from the LB), must learn that by direct
//! scrape and through a real Prometheus, and cut TTFT.
//!
//! A vLLM server takes ~2 GB and ~30 s to start: one test starts the pair and runs every check on
//! it, and the binary runs alone (`.config/nextest.toml`).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use llm_lc_testkit::controller::Running;
use llm_lc_testkit::haproxy::{standard_config, Haproxy};
use llm_lc_testkit::load::{closed_loop_of, prompt, LoadStats};
use llm_lc_testkit::prometheus::Prometheus;
use llm_lc_testkit::vllm::{Options, VllmServer, MODEL};
use llm_lc_testkit::wait;

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

/// Tokens per request: at ~300 tokens/s per stream a request holds its slot for about a second.
const TOKENS: u32 = 256;
/// Closed-loop clients: more than the pair runs at once (4 + 1), so a queue forms somewhere.
const CLIENTS: usize = 5;

/// A streaming completion of `TOKENS` tokens. No per-request `seed` (see [`long_body`]).
fn body(seed: u64, n: u64) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL,
        "prompt": prompt(seed, n, 40),
        "max_tokens": TOKENS,
        "ignore_eos": true,
        "stream": true,
        "temperature": 1.0,
    })
}

async fn load(url: &str, secs: u64, seed: u64) -> LoadStats {
    closed_loop_of(url, CLIENTS, Duration::from_secs(secs), move |c, n| body(seed ^ ((c as u64) << 32), n))
        .await
}

/// A HAProxy backend `llm` over the servers, `balance leastconn`, equal weights.
async fn haproxy_over(servers: &[&VllmServer]) -> Haproxy {
    let lines: String = servers
        .iter()
        .enumerate()
        .map(|(i, s)| format!("    server s{i} {} weight 100\n", s.addr()))
        .collect();
    Haproxy::start(&standard_config(&format!(
        "backend llm\n    balance leastconn\n{lines}\nfrontend fe\n    bind 127.0.0.1:{{{{PORT:fe}}}}\n    \
         timeout client 120s\n    default_backend llm\n"
    )))
    .await
}

/// The weights HAProxy holds for (big, small) once the 4-seq server has had at least twice the
/// other's for three of the controller's cycles (it keeps learning while the load runs: the first
/// push may come before the big server has shown its own limit).
async fn pushed_weights(h: &Haproxy, log: impl Fn() -> String) -> (u32, u32) {
    // Since when the 4-seq server has held at least twice the other's weight (the values may move).
    let since = std::sync::Mutex::new(None::<std::time::Instant>);
    let seen = std::sync::Mutex::new(Vec::<(u32, u32)>::new());
    wait::until_or(
        Duration::from_secs(90),
        "the controller's weights, the 4-seq server at least twice the other's for 6 s",
        || async {
            let w = h.state_weights("llm").await;
            let now = (*w.get("s0")?, *w.get("s1")?);
            let mut seen = seen.lock().ok()?;
            if seen.last() != Some(&now) {
                seen.push(now);
            }
            let mut since = since.lock().ok()?;
            if now.0 < 2 * now.1.max(1) {
                *since = None;
                return None;
            }
            let at = *since.get_or_insert_with(std::time::Instant::now);
            (at.elapsed() >= Duration::from_secs(6)).then_some(now)
        },
        || format!("weights seen: {:?}\n{}", seen.lock().map(|s| s.clone()).unwrap_or_default(), log()),
    )
    .await
}

/// The controller with its defaults (`profile: vllm`, members from HAProxy) on `source`: load runs
/// until its weights favour the 4-seq server for 6 s, then the measured run. Returns that run.
async fn controlled(
    h: &Haproxy,
    lb: &str,
    what: &str,
    source: &str,
    pool: &str,
    sink: &str,
    seed: u64,
) -> LoadStats {
    let ctl = Running::start(
        Path::new(BIN),
        "2s",
        &format!(
            "sources:\n  {source}\npools:\n  - name: llm\n    {pool}\n    profile: vllm\n    \
             members: {{from_lb: true}}\n    sink: {sink}\n"
        ),
    );
    let warm = tokio::spawn({
        let lb = lb.to_string();
        async move { load(&lb, 20, seed).await }
    });
    let weights = pushed_weights(h, || ctl.log()).await;
    warm.await.expect("load");
    let measured = load(lb, 20, seed + 1).await;
    report(&format!("controller {what} {weights:?}"), &measured);
    measured
}

/// One row of the tables the tests print (RESULTS.md's columns after the first).
fn report(what: &str, s: &LoadStats) {
    println!(
        "| {what} | {:?} | {:?} | {:?} | {} | {} | {:.0} |",
        s.ttft_quantile(0.5),
        s.ttft_quantile(0.9),
        s.ttft_quantile(0.99),
        s.completed,
        s.failed,
        s.tokens_per_second()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_demo_on_real_vllm_learns_the_batch_limits_and_cuts_ttft() {
    let servers = VllmServer::start_all(&[Options::new(4, 32, 0), Options::new(1, 32, 1)]).await;
    let (big, small) = (&servers[0], &servers[1]);
    let h = haproxy_over(&[big, small]).await;
    let lb = format!("http://127.0.0.1:{}", h.port("fe"));

    // Equal weights. Meanwhile, the quick start a newcomer types first reads the servers as they
    // are under that load: one dry-run cycle, no config file.
    let equal = tokio::spawn({
        let lb = lb.clone();
        async move { load(&lb, 20, 1).await }
    });
    wait::until(Duration::from_secs(20), "the 1-seq server to queue", || async {
        (small.gauge("vllm:num_requests_waiting").await? >= 1.0).then_some(())
    })
    .await;
    let out = Command::new(BIN)
        .args(["run", "--dry-run", "--once", "--output", "json", "--profile", "vllm", "--scrape"])
        .arg(format!("{},{}", big.addr(), small.addr()))
        .env_remove("LLMLC_CONFIG")
        .output()
        .expect("run --once");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    let ratio = |s: &VllmServer| {
        v["pools"][0]["members"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["member"] == s.addr().as_str()))
            .and_then(|m| m["ratio"].as_u64())
    };
    let (rb, rs) = (ratio(big).expect("big"), ratio(small).expect("small"));
    assert!(rb >= 2 * rs, "quick start: the 4-seq server first, at least twice: {rb} vs {rs}\n{v}");
    let equal = equal.await.expect("load");
    report("equal weights", &equal);

    // The controller with its defaults, by direct scrape, members from HAProxy's own backend.
    let sink = format!("{{kind: haproxy, address: '{}', backend: llm}}", h.runtime_address());
    let scraped =
        controlled(&h, &lb, "by scrape", "direct: {kind: scrape}", "source: direct", &sink, 2).await;

    // The OpenShift path: a real Prometheus scrapes the servers, the controller asks it.
    for s in ["s0", "s1"] {
        h.command(&format!("set server llm/{s} weight 100")).await;
    }
    let prom = Prometheus::start("vllm", &[big.addr(), small.addr()]).await;
    let source = format!("prom: {{kind: prometheus, url: '{}', rate_window: 10s}}", prom.url());
    let pool = "source: prom\n    selector: 'job=\"vllm\"'";
    let through_prom = controlled(&h, &lb, "through Prometheus", &source, pool, &sink, 4).await;

    assert_eq!((equal.failed, scraped.failed, through_prom.failed), (0, 0, 0), "{:?}", scraped.errors);
    let p90 = |s: &LoadStats| s.ttft_quantile(0.9).as_secs_f64();
    assert!(
        p90(&scraped) <= 0.5 * p90(&equal),
        "by scrape: TTFT p90 {:?} against {:?} with equal weights",
        scraped.ttft_quantile(0.9),
        equal.ttft_quantile(0.9)
    );
    assert!(
        p90(&through_prom) <= 0.5 * p90(&equal),
        "through Prometheus: TTFT p90 {:?} against {:?} with equal weights",
        through_prom.ttft_quantile(0.9),
        equal.ttft_quantile(0.9)
    );
}

/// Long prompts (~1,400 tokens with the tests' tokenizer) so that memory, not the batch limit,
/// binds on the small server (8 MiB: 4,096 tokens, two such requests). No per-request `seed`:
/// on vLLM 0.32 for CPU a seeded request whose prompt is prefilled in chunks kills the engine
/// ("CPU Generator does not use offset"; every request after it answers 500).
fn long_body(seed: u64, n: u64) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL,
        "prompt": prompt(seed, n, 400),
        "max_tokens": TOKENS,
        "ignore_eos": true,
        "stream": true,
        "temperature": 1.0,
    })
}

/// A pair that differs in KV memory only (8 vs 64 MiB, both `--max-num-seqs 8`), eight clients
/// with long prompts: the controller against every static ratio of a sweep, in one run. Prints the
/// table of src/bench/RESULTS.md ("Real vLLM"); `tests/vllm/compare.sh` runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a 3-minute measurement; tests/vllm/compare.sh runs it"]
async fn memory_only_pair_against_a_sweep_of_static_ratios() {
    let servers = VllmServer::start_all(&[Options::new(8, 64, 0), Options::new(8, 8, 1)]).await;
    let (big, small) = (&servers[0], &servers[1]);
    let h = haproxy_over(&[big, small]).await;
    let lb = format!("http://127.0.0.1:{}", h.port("fe"));
    let secs = std::env::var("LLMLC_COMPARE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(15u64);
    let run = |seed: u64| {
        let lb = lb.clone();
        async move {
            closed_loop_of(&lb, 8, Duration::from_secs(secs), move |c, n| {
                long_body(seed ^ ((c as u64) << 32), n)
            })
            .await
        }
    };
    let mut rows = Vec::new();
    for (b, s) in [(100, 100), (100, 50), (100, 25), (100, 12)] {
        h.command(&format!("set server llm/s0 weight {b}")).await;
        h.command(&format!("set server llm/s1 weight {s}")).await;
        let stats = run(b * 1000 + s).await;
        rows.push((format!("static {b}/{s}"), stats));
    }
    for s in ["s0", "s1"] {
        h.command(&format!("set server llm/{s} weight 100")).await;
    }
    let sink = format!("{{kind: haproxy, address: '{}', backend: llm}}", h.runtime_address());
    let ctl = Running::start(
        Path::new(BIN),
        "2s",
        &format!(
            "sources:\n  direct: {{kind: scrape}}\npools:\n  - name: llm\n    source: direct\n    \
             profile: vllm\n    members: {{from_lb: true}}\n    sink: {sink}\n"
        ),
    );
    let warm = run(7).await;
    let w = h.state_weights("llm").await;
    let stats = run(8).await;
    let w_after = h.state_weights("llm").await;
    println!("| weights (64 MiB / 8 MiB) | TTFT p50 | TTFT p90 | TTFT p99 | requests | failed | tok/s |");
    println!("|---|---|---|---|---|---|---|");
    for (name, s) in &rows {
        report(name, s);
    }
    report(&format!("controller {}/{} -> {}/{}", w["s0"], w["s1"], w_after["s0"], w_after["s1"]), &stats);
    let _ = warm;
    drop(ctl);
    for (name, s) in rows.iter().chain([&("controller".to_string(), stats.clone())]) {
        assert!(
            s.failed == 0 && s.completed > 0,
            "{name}: {} completed, {} failed: {:?}",
            s.completed,
            s.failed,
            s.errors
        );
    }
    let best = rows.iter().map(|(_, s)| s.ttft_quantile(0.9)).min().expect("rows");
    assert!(
        stats.ttft_quantile(0.9).as_secs_f64() <= 1.25 * best.as_secs_f64(),
        "controller p90 {:?} against the best static {:?}",
        stats.ttft_quantile(0.9),
        best
    );
}
