//! Soak: the controller binary against a real HAProxy and three metrics pages while faults are
//! injected every couple of seconds into the source (garbage pages, a page that stops answering),
//! the sink (HAProxy stopped and started) and the config (an invalid version written over the live
//! file, then the valid one again).
//!
//! Asserts: the process never exits; no gap between two cycle reports is longer than the interval
//! plus one second; RSS grows by less than 32 MiB; once the faults stop, HAProxy holds exactly the
//! ratios of the controller's last cycle.
//!
//! The test command runs a short version (`LLMLC_SOAK_SECS`, default 20 s). The long one:
//! `LLMLC_SOAK_SECS=900 cargo nextest run --test soak --no-capture`.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use llm_lc_testkit::haproxy::{standard_config, Haproxy};
use llm_lc_testkit::metrics_target::{vllm_text, MetricsTarget};
use llm_lc_testkit::{ports, wait};
use rand::{Rng, SeedableRng};

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()
}

/// `2026-12-03T06:01:57.133690902Z` -> seconds since midnight (UTC), from the RFC 3339 time part.
fn seconds_of_day(ts: &str) -> Option<f64> {
    let time = ts.split_once('T')?.1.trim_end_matches('Z');
    let mut parts = time.splitn(3, ':');
    let (h, m, s) = (parts.next()?.parse::<f64>().ok()?, parts.next()?.parse::<f64>().ok()?, parts.next()?);
    Some(h * 3600.0 + m * 60.0 + s.parse::<f64>().ok()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_rides_through_minutes_of_faults() {
    let secs: u64 = std::env::var("LLMLC_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let pages = [(1.0, 60.0, 0.5), (5.0, 40.0, 0.7), (12.0, 20.0, 0.95)];
    let mut targets = Vec::new();
    for (w, r, kv) in pages {
        targets.push(MetricsTarget::vllm(w, r, kv).await);
    }
    let servers: String = targets
        .iter()
        .enumerate()
        .map(|(i, t)| format!("    server s{i} {} weight 1\n", t.member()))
        .collect();
    let mut haproxy =
        Haproxy::start(&standard_config(&format!("backend llm\n    balance leastconn\n{servers}"))).await;

    let dir = tempfile::tempdir().expect("tmp");
    let listen = ports::free_port();
    let members = targets.iter().map(|t| format!("'{}'", t.member())).collect::<Vec<_>>().join(", ");
    let good = format!(
        "interval: 300ms\nlisten: 127.0.0.1:{listen}\nsources:\n  direct: {{ kind: scrape, timeout: 500ms }}\n\
         pools:\n  - name: llm\n    source: direct\n    members: {{ static: [{members}] }}\n    \
         sink: {{ kind: haproxy, address: '{}', backend: llm, timeout: 500ms }}\n",
        haproxy.runtime_tcp_address()
    );
    let cfg = dir.path().join("controller.yaml");
    std::fs::write(&cfg, &good).expect("config");
    let out_path = dir.path().join("cycles.jsonl");
    let mut child = Command::new(BIN)
        .args(["run", "--output", "json", "--config"])
        .arg(&cfg)
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(Stdio::null())
        .spawn()
        .expect("start controller");
    let pid = child.id();
    let ratios_url = format!("http://127.0.0.1:{listen}/v1/ratios");
    wait::http_ok(&ratios_url, Duration::from_secs(20)).await;
    let rss_start = rss_kib(pid).expect("rss");

    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let started = Instant::now();
    let mut step = 0u32;
    while started.elapsed() < Duration::from_secs(secs) {
        let fault = rng.gen_range(0..4);
        match fault {
            0 => targets[step as usize % 3]
                .set("vllm:num_requests_waiting{engine=\"0\"} NaN\n\u{1}garbage {{{\n"),
            1 => targets[step as usize % 3].set(""),
            2 => haproxy.stop().await,
            _ => std::fs::write(&cfg, "interval: nonsense\npools: [\n").expect("bad config"),
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(500..2000))).await;
        // Undo: pages back, HAProxy up, the valid config back.
        for (t, (w, r, kv)) in targets.iter().zip(pages) {
            t.set(&vllm_text(w, r, kv));
        }
        if fault == 2 {
            haproxy.start_again().await;
        }
        if fault == 3 {
            std::fs::write(&cfg, &good).expect("config");
        }
        assert!(child.try_wait().expect("wait").is_none(), "the controller exited during fault {fault}");
        tokio::time::sleep(Duration::from_millis(rng.gen_range(300..1500))).await;
        step += 1;
    }
    let rss_end = rss_kib(pid).expect("rss");

    // Faults over: HAProxy (possibly restarted, weights lost) converges to the last cycle's ratios.
    let names: Vec<String> = targets.iter().map(MetricsTarget::member).collect();
    wait::until(Duration::from_secs(20), "HAProxy to hold the last computed ratios", || async {
        let v: serde_json::Value = reqwest::get(&ratios_url).await.ok()?.json().await.ok()?;
        let want: BTreeMap<String, u64> = v["pools"][0]["members"]
            .as_array()?
            .iter()
            .filter_map(|m| Some((m["member"].as_str()?.to_string(), m["ratio"].as_u64()?)))
            .collect();
        let have = haproxy.state_weights("llm").await;
        let all =
            (0..3).all(|i| have.get(&format!("s{i}")).map(|w| u64::from(*w)) == want.get(&names[i]).copied());
        (want.len() == 3 && all).then_some(())
    })
    .await;
    assert!(child.try_wait().expect("wait").is_none(), "the controller exited");
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = child.wait();

    let grew_mib = rss_end.saturating_sub(rss_start) as f64 / 1024.0;
    assert!(grew_mib < 32.0, "RSS grew {grew_mib:.1} MiB over {secs} s");
    let text = std::fs::read_to_string(&out_path).expect("cycles");
    let stamps: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["ts"].as_str().and_then(seconds_of_day))
        .collect();
    assert!(stamps.len() as u64 >= secs, "{} cycles in {secs} s", stamps.len());
    // Seconds of the day; a run across midnight wraps once.
    let worst = stamps.windows(2).map(|w| (w[1] - w[0]).rem_euclid(86_400.0)).fold(0.0, f64::max);
    assert!(worst <= 0.3 + 1.0, "a cycle came {worst:.2} s after the previous one (interval 0.3 s)");
    eprintln!(
        "soak {secs} s, {step} faults: {} cycles, worst gap {worst:.2} s, RSS {:.1} -> {:.1} MiB",
        stamps.len(),
        rss_start as f64 / 1024.0,
        rss_end as f64 / 1024.0
    );
}
