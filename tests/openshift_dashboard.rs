//! The dashboards (deploy/grafana): the Grafana JSON and the OpenShift console's ConfigMap. Both
//! well-formed for what renders them, every controller metric they name is one the controller
//! really exports, and every query (and every console variable query) runs on a real Prometheus
//! scraping a real controller and a vLLM-like metrics page, with the key panels returning data.

mod leader_support;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use leader_support::Proc;
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::prometheus::Prometheus;
use llm_lc_testkit::{ports, wait};
use serde_json::Value;

fn dashboard() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/llm-load-controller.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("read the dashboard")).expect("valid JSON")
}

/// The OpenShift console's dashboard ConfigMap, and the dashboard JSON inside it.
fn console() -> (ConfigMap, Value) {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/openshift-console-dashboard.yaml");
    let cm: ConfigMap =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&p).expect("read the console dashboard"))
            .expect("ConfigMap");
    let data = cm.data.clone().expect("data");
    assert_eq!(data.len(), 1, "one dashboard per ConfigMap");
    let (key, json) = data.iter().next().expect("one key");
    assert!(key.ends_with(".json"), "{key}");
    let d = serde_json::from_str(json).expect("the dashboard is valid JSON");
    (cm, d)
}

/// Panels, with those nested in rows (the console's layout) flattened in.
fn all_panels(d: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        out.push(p.clone());
        out.extend(p["panels"].as_array().cloned().unwrap_or_default());
    }
    out
}

/// (panel title, expression) of every query.
fn queries(d: &Value) -> Vec<(String, String)> {
    all_panels(d)
        .into_iter()
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

/// Panel types the OpenShift console renders (others are silently dropped by it).
const CONSOLE_PANELS: [&str; 6] = ["row", "graph", "singlestat", "table", "gauge", "grafana-piechart-panel"];

#[test]
fn console_dashboard_is_a_configmap_the_console_picks_up_with_panels_it_renders() {
    let (cm, d) = console();
    assert_eq!(cm.metadata.namespace.as_deref(), Some("openshift-config-managed"));
    let labels = cm.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("console.openshift.io/dashboard").map(String::as_str), Some("true"));
    assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()), "the console lists dashboards by title");
    let mut ids = BTreeSet::new();
    let mut n = 0;
    for p in all_panels(&d) {
        let kind = p["type"].as_str().expect("type");
        assert!(CONSOLE_PANELS.contains(&kind), "{}: the console does not render {kind}", p["title"]);
        assert!(ids.insert(p["id"].as_u64().expect("id")), "duplicate panel id {}", p["id"]);
        if kind == "row" {
            assert!(p["panels"].as_array().is_some_and(|x| !x.is_empty()), "{}: empty row", p["title"]);
            continue;
        }
        n += 1;
        let span = p["span"].as_u64().expect("span (the console's width, of 12)");
        assert!((1..=12).contains(&span), "{}: span {span}", p["title"]);
        assert!(!p["targets"].as_array().expect("targets").is_empty(), "{}", p["title"]);
    }
    assert!(n >= 10, "{n} panels");
    let vars: Vec<&str> =
        d["templating"]["list"].as_array().expect("vars").iter().filter_map(|v| v["name"].as_str()).collect();
    let var_queries: Vec<String> = d["templating"]["list"]
        .as_array()
        .expect("vars")
        .iter()
        .map(|v| v["query"].as_str().expect("query").to_string())
        .collect();
    for (title, e) in queries(&d).into_iter().chain(var_queries.into_iter().map(|q| ("variable".into(), q))) {
        for word in e.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$')) {
            if let Some(v) = word.strip_prefix('$') {
                assert!(
                    vars.contains(&v) || v == "__rate_interval",
                    "{title}: ${v} is not a dashboard variable"
                );
            }
        }
    }
}

/// A console variable's query as the console sends it: `label_values(X, L)` becomes `count(X) by (L)`.
fn console_variable_query(q: &str) -> String {
    let inner = q.strip_prefix("label_values(").and_then(|x| x.strip_suffix(')')).expect("label_values(...)");
    let (expr, label) = inner.rsplit_once(", ").expect("label_values(metric, label)");
    format!("count({expr}) by ({label})")
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
        "vllm:request_inference_time_seconds_bucket",
    ];
    let d = dashboard();
    let (_, console) = console();
    let qs = queries(&d);
    let console_qs: Vec<(String, String)> = queries(&console)
        .into_iter()
        .chain(console["templating"]["list"].as_array().expect("vars").iter().map(|v| {
            (format!("variable {}", v["name"]), console_variable_query(v["query"].as_str().expect("query")))
        }))
        .collect();
    for (title, e) in qs.iter().chain(&console_qs) {
        for n in metric_names(e) {
            let ours = n.starts_with("llmlc_") || n.starts_with("process_");
            let known = if ours { exported.contains(&n) } else { vllm.contains(&n.as_str()) };
            assert!(known, "{title}: {n} is not a metric the controller or vLLM exports");
        }
    }

    // Real Prometheus scraping the controller and the vLLM pages; variables as Grafana would fill
    // them when the series carry no namespace label (plain scrape).
    let mut scraped = members.clone();
    scraped.push(format!("127.0.0.1:{listen}"));
    // The job name the ServiceMonitor gives the controller (the console's process_* panels select it).
    let prom = Prometheus::start("llm-load-controller", &scraped).await;
    prom.wait_for_series("llmlc_member_weight", 2, Duration::from_secs(30)).await;
    prom.wait_for_series("vllm:num_requests_waiting", 2, Duration::from_secs(30)).await;
    // The panels' rate() windows need two scrapes of the controller (the vLLM pages here are
    // gauges only): wait until a rate over its counters answers.
    prom.wait_for_series("rate(llmlc_cycle_duration_seconds_count[1m])", 1, Duration::from_secs(30)).await;
    let grafana_vars = [("$namespace", ""), ("$vllm_namespace", ""), ("$pool", ".*")];
    let grafana_must =
        ["Leader", "Ratio per member", "Waiting requests", "KV cache usage", "Pool saturation"];
    run_all(&prom, &qs, &grafana_vars, &grafana_must).await;
    // The console fills "All" with `.+` and $__rate_interval with at least 5m.
    let console_vars =
        [("$namespace", ""), ("$vllm_namespace", ""), ("$pool", ".+"), ("$__rate_interval", "5m")];
    let console_must = [
        "Leaders",
        "Weight per member",
        "Pool saturation",
        "Members now",
        "Controller memory",
        "Waiting requests",
        "KV cache usage",
        "variable \"pool\"",
    ];
    run_all(&prom, &console_qs, &console_vars, &console_must).await;
}

/// Run every query with the variables filled in; the named panels must return data.
async fn run_all(prom: &Prometheus, qs: &[(String, String)], vars: &[(&str, &str)], must_have_data: &[&str]) {
    let http = reqwest::Client::new();
    let mut seen = BTreeSet::new();
    for (title, e) in qs {
        let q = vars.iter().fold(e.clone(), |q, (k, v)| q.replace(k, v));
        assert!(!q.contains('$'), "{title}: unfilled variable in {q}");
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
        if must_have_data.contains(&title.as_str()) {
            assert!(n > 0, "{title}: no data for {q}");
            seen.insert(title.as_str());
        }
    }
    assert_eq!(
        seen.len(),
        must_have_data.len(),
        "panels named but not found: {must_have_data:?} vs {seen:?}"
    );
}
