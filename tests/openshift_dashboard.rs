//! The Grafana dashboard (deploy/grafana): well-formed, every controller metric it names is one the
//! controller really exports, and every query runs on a real Prometheus scraping a real controller
//! and a vLLM-like metrics page, with the key panels returning data.

mod leader_support;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use leader_support::Proc;
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::prometheus::Prometheus;
use llm_lc_testkit::{ports, wait};
use serde_json::Value;

fn dashboard() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/llm-load-controller.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("read the dashboard")).expect("valid JSON")
}

/// (panel title, expression) of every query.
fn queries(d: &Value) -> Vec<(String, String)> {
    d["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            p["targets"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |t| (title.clone(), t["expr"].as_str().expect("expr").to_string()))
        })
        .collect()
}

/// Metric names in a PromQL expression: identifiers (with `:`) followed by `{`.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_alphabetic() || b[i] == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b':') {
                i += 1;
            }
            if b.get(i) == Some(&b'{') {
                out.insert(expr[start..i].to_string());
            }
        } else {
            i += 1;
        }
    }
    out
}

#[test]
fn panels_are_well_formed() {
    let d = dashboard();
    assert_eq!(d["uid"], "llm-load-controller");
    let panels = d["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut cells = BTreeSet::new();
    for p in panels {
        assert!(ids.insert(p["id"].as_u64().expect("id")), "duplicate panel id {}", p["id"]);
        let g = &p["gridPos"];
        let (x, y, w, h) = (
            g["x"].as_u64().expect("x"),
            g["y"].as_u64().expect("y"),
            g["w"].as_u64().expect("w"),
            g["h"].as_u64().expect("h"),
        );
        assert!(x + w <= 24 && w > 0 && h > 0, "{}: off the 24-column grid", p["title"]);
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(cells.insert((cx, cy)), "{} overlaps another panel at ({cx},{cy})", p["title"]);
            }
        }
        if p["type"] != "row" {
            assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
            assert!(!p["targets"].as_array().expect("targets").is_empty(), "{}", p["title"]);
        }
    }
    let vars: Vec<&str> =
        d["templating"]["list"].as_array().expect("vars").iter().filter_map(|v| v["name"].as_str()).collect();
    for (title, e) in queries(&d) {
        for v in ["namespace", "pool", "vllm_namespace", "datasource"] {
            if e.contains(&format!("${v}")) {
                assert!(vars.contains(&v), "{title}: ${v} is not a dashboard variable");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_runs_on_real_prometheus_against_a_real_controller() {
    let targets = [MetricsTarget::vllm(0.0, 3.0, 0.2).await, MetricsTarget::vllm(6.0, 40.0, 0.8).await];
    let members: Vec<String> = targets.iter().map(|t| t.member()).collect();
    let tmp = tempfile::tempdir().expect("tmp");
    let listen = ports::free_port();
    let cfg = tmp.path().join("c.yaml");
    let list = members.iter().map(|m| format!("'{m}'")).collect::<Vec<_>>().join(", ");
    std::fs::write(
        &cfg,
        format!(
            "interval: 500ms\nlisten: 127.0.0.1:{listen}\nsources:\n  direct: {{ kind: scrape }}\n\
             pools:\n  - name: llm\n    source: direct\n    members: {{ static: [{list}] }}\n"
        ),
    )
    .expect("config");
    let p = Proc::start(&cfg, listen, &[], &tmp.path().join("log"));
    wait::http_ok(&format!("http://127.0.0.1:{listen}/readyz"), Duration::from_secs(10)).await;

    // Every llmlc_ name in the dashboard is exported by the controller; vLLM names are documented ones.
    let (_, exposition) = p.get("/metrics").await.expect("metrics");
    let mut exported = BTreeSet::new();
    for l in exposition.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            let mut it = rest.split(' ');
            let (name, kind) = (it.next().unwrap_or_default(), it.next().unwrap_or_default());
            match kind {
                "counter" => exported.insert(format!("{name}_total")),
                "histogram" => {
                    ["_bucket", "_sum", "_count"].iter().all(|s| exported.insert(format!("{name}{s}")))
                }
                _ => exported.insert(name.to_string()),
            };
        }
    }
    let vllm = [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ];
    let d = dashboard();
    let qs = queries(&d);
    for (title, e) in &qs {
        for n in metric_names(e) {
            let known =
                if n.starts_with("llmlc_") { exported.contains(&n) } else { vllm.contains(&n.as_str()) };
            assert!(known, "{title}: {n} is not a metric the controller or vLLM exports");
        }
    }

    // Real Prometheus scraping the controller and the vLLM pages; variables as Grafana would fill
    // them when the series carry no namespace label (plain scrape).
    let mut scraped = members.clone();
    scraped.push(format!("127.0.0.1:{listen}"));
    let prom = Prometheus::start("llm", &scraped).await;
    prom.wait_for_series("llmlc_member_weight", 2, Duration::from_secs(30)).await;
    prom.wait_for_series("vllm:num_requests_waiting", 2, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(2)).await; // a few more scrapes for the rate() windows
    let http = reqwest::Client::new();
    for (title, e) in &qs {
        let q = e.replace("$namespace", "").replace("$vllm_namespace", "").replace("$pool", ".*");
        let r: Value = http
            .get(format!("{}/api/v1/query", prom.url()))
            .query(&[("query", q.as_str())])
            .send()
            .await
            .expect("query")
            .json()
            .await
            .expect("JSON");
        assert_eq!(r["status"], "success", "{title}: {q}\n{r}");
        let n = r["data"]["result"].as_array().map(Vec::len).unwrap_or(0);
        let must_have_data =
            ["Leader", "Ratio per member", "Waiting requests", "KV cache usage", "Pool saturation"];
        if must_have_data.contains(&title.as_str()) {
            assert!(n > 0, "{title}: no data for {q}");
        }
    }
}
