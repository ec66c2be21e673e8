//! The controller's `/metrics` as a scraper sees it: the OpenMetrics content type, HELP and TYPE on
//! every family, Prometheus naming conventions (counters end in `_total`, `_ratio` gauges stay in
//! 0..1, base units), `llmlc_build_info`, plausible `process_*` values for the real process, the
//! renamed `llmlc_member_weight` beside its deprecated old name, and a real Prometheus ingesting it
//! all with the help texts in its metadata.

mod leader_support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leader_support::Proc;
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::prometheus::Prometheus;
use llm_lc_testkit::{ports, wait};
use serde_json::Value;

#[derive(Debug, Default)]
struct Family {
    kind: String,
    help: String,
    /// (sample name, labels text, value)
    samples: Vec<(String, String, f64)>,
}

/// Parse the exposition into families; panics on anything OpenMetrics forbids that we can see here.
fn families(text: &str) -> BTreeMap<String, Family> {
    let mut out: BTreeMap<String, Family> = BTreeMap::new();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.last(), Some(&"# EOF"), "OpenMetrics ends with # EOF");
    for l in &lines[..lines.len() - 1] {
        if let Some(rest) = l.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.entry(name.into()).or_default().help = help.into();
        } else if let Some(rest) = l.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE has a kind");
            out.entry(name.into()).or_default().kind = kind.into();
        } else if l.starts_with('#') {
            panic!("unexpected comment line {l:?}");
        } else {
            let (series, value) = l.rsplit_once(' ').expect("sample has a value");
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {l:?}"));
            // The family: the longest declared name the sample name starts with, by type suffixes.
            let fam = out
                .iter()
                .filter(|(f, fam)| {
                    let suffixes: &[&str] = match fam.kind.as_str() {
                        "counter" => &["_total", "_created"],
                        "histogram" => &["_bucket", "_sum", "_count", "_created"],
                        "info" => &["_info"],
                        _ => &[""],
                    };
                    suffixes.iter().any(|s| name == format!("{f}{s}"))
                })
                .map(|(f, _)| f.clone())
                .next()
                .unwrap_or_else(|| panic!("sample {name} has no TYPE line of its family"));
            out.get_mut(&fam).expect("family").samples.push((name.into(), labels.into(), value));
        }
    }
    out
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_openmetrics_and_prometheus_conventions() {
    let started = now();
    let targets = [MetricsTarget::vllm(0.0, 3.0, 0.2).await, MetricsTarget::vllm(8.0, 40.0, 0.8).await];
    let tmp = tempfile::tempdir().expect("tmp");
    let listen = ports::free_port();
    let cfg = tmp.path().join("c.yaml");
    let list = targets.iter().map(|t| format!("'{}'", t.member())).collect::<Vec<_>>().join(", ");
    std::fs::write(
        &cfg,
        format!(
            "interval: 300ms\nlisten: 127.0.0.1:{listen}\nsources:\n  direct: {{ kind: scrape }}\n\
             pools:\n  - name: llm\n    source: direct\n    members: {{ static: [{list}] }}\n"
        ),
    )
    .expect("config");
    let p = Proc::start(&cfg, listen, &[], &tmp.path().join("log"));
    wait::http_ok(&format!("http://127.0.0.1:{listen}/readyz"), Duration::from_secs(10)).await;

    let r = reqwest::get(format!("http://127.0.0.1:{listen}/metrics")).await.expect("GET /metrics");
    assert_eq!(r.headers()["content-type"], "application/openmetrics-text; version=1.0.0; charset=utf-8");
    let text = r.text().await.expect("body");
    let fams = families(&text);

    let name_ok = regex::Regex::new("^[a-zA-Z_][a-zA-Z0-9_]*$").expect("regex");
    for (name, f) in &fams {
        assert!(name_ok.is_match(name), "{name}: not a valid metric name");
        assert!(name.starts_with("llmlc_") || name.starts_with("process_"), "{name}: foreign prefix");
        assert!(!f.help.trim().is_empty(), "{name}: no HELP");
        assert!(
            ["gauge", "counter", "histogram", "info"].contains(&f.kind.as_str()),
            "{name}: TYPE {}",
            f.kind
        );
        assert!(!name.ends_with("_total"), "{name}: family names carry no _total (samples do)");
        if f.kind == "gauge" {
            for bad in ["_count", "_sum", "_bucket"] {
                assert!(!name.ends_with(bad), "{name}: gauge with a reserved suffix");
            }
        }
        // The old name of the weight is kept one release for existing dashboards (the exception).
        if name.ends_with("_ratio") && name != "llmlc_member_ratio" {
            for (s, l, v) in &f.samples {
                assert!((0.0..=1.0).contains(v), "{s}{{{l}}} = {v}: a _ratio must stay within 0..1");
            }
        }
        for unit in ["_ms", "_milliseconds", "_kb", "_mb", "_percent"] {
            assert!(!name.ends_with(unit), "{name}: use base units (seconds, bytes, 0..1 ratios)");
        }
    }

    // The weight under its new name, and the same series under the deprecated one.
    let weight = &fams["llmlc_member_weight"];
    let old = &fams["llmlc_member_ratio"];
    assert_eq!(weight.samples.len(), 2, "{:?}", weight.samples);
    let members: BTreeSet<&str> = weight.samples.iter().map(|(_, l, _)| l.as_str()).collect();
    assert_eq!(members.len(), 2, "one series per member");
    for ((_, l1, v1), (_, l2, v2)) in weight.samples.iter().zip(&old.samples) {
        assert_eq!((l1, v1), (l2, v2));
    }
    assert!(old.help.to_lowercase().contains("deprecated"), "{}", old.help);

    // Build info.
    let bi = &fams["llmlc_build_info"].samples;
    assert_eq!(bi.len(), 1);
    assert_eq!(bi[0].2, 1.0);
    assert!(bi[0].1.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))), "{}", bi[0].1);
    assert!(bi[0].1.contains("git_commit=\""), "{}", bi[0].1);

    // Process metrics describe the controller process itself.
    let one =
        |n: &str| fams.get(n).and_then(|f| f.samples.first()).map(|s| s.2).unwrap_or_else(|| panic!("{n}"));
    assert_eq!(fams["process_cpu_seconds"].kind, "counter");
    assert_eq!(fams["process_cpu_seconds"].samples[0].0, "process_cpu_seconds_total");
    let start = one("process_start_time_seconds");
    assert!(start >= started - 2.0 && start <= now() + 1.0, "start {start} vs test start {started}");
    assert!(one("process_resident_memory_bytes") > 1e6);
    let fds = one("process_open_fds");
    let real = std::fs::read_dir(format!("/proc/{}/fd", p.pid())).expect("the child's fds").count() as f64;
    assert!((fds - real).abs() <= 4.0, "open fds {fds}, /proc says {real}");
    assert!(one("process_max_fds") >= fds);

    // A real Prometheus scrapes it (negotiating OpenMetrics) and keeps every family's help text.
    let prom = Prometheus::start("ctl", &[format!("127.0.0.1:{listen}")]).await;
    prom.wait_for_series("llmlc_member_weight", 2, Duration::from_secs(30)).await;
    prom.wait_for_series("process_cpu_seconds_total", 1, Duration::from_secs(30)).await;
    let up = prom.query("up{job=\"ctl\"}").await;
    assert_eq!(up[0]["value"][1], "1");
    let meta: Value = reqwest::Client::new()
        .get(format!("{}/api/v1/targets/metadata", prom.url()))
        .query(&[("match_target", "{job=\"ctl\"}")])
        .send()
        .await
        .expect("metadata")
        .json()
        .await
        .expect("JSON");
    let known: BTreeMap<String, (String, String)> = meta["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| {
            let s = |k: &str| m[k].as_str().unwrap_or_default().to_string();
            (s("metric"), (s("type"), s("help")))
        })
        .collect();
    for (name, f) in &fams {
        let (kind, help) = known.get(name).unwrap_or_else(|| panic!("{name}: not in Prometheus' metadata"));
        assert_eq!(kind, &f.kind, "{name}");
        assert!(!help.is_empty(), "{name}: Prometheus has no help text");
    }
    drop(p);
}
