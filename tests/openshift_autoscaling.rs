//! The autoscaling example's query (deploy/openshift/autoscaling/keda-scaledobject.yaml) on a real
//! Prometheus scraping a real controller: it follows the servers' load (low when idle, past the
//! threshold when busy, so the HPA formula adds replicas) and is empty, not zero, when the pool has
//! no fresh data (so KEDA, with ignoreNullValues "false", holds instead of scaling in).

mod leader_support;

use std::path::Path;
use std::time::Duration;

use leader_support::Proc;
use llm_lc_testkit::metrics_target::{vllm_text, MetricsTarget};
use llm_lc_testkit::prometheus::Prometheus;
use llm_lc_testkit::{ports, wait};
use serde_yaml_ng::Value;

/// (query, threshold) of the ScaledObject's trigger.
fn trigger() -> (String, f64) {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/openshift/autoscaling/keda-scaledobject.yaml");
    let text = std::fs::read_to_string(p).expect("read the ScaledObject");
    let so: Value = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML"))
        .find(|d: &Value| d["kind"] == "ScaledObject")
        .expect("a ScaledObject");
    let md = &so["spec"]["triggers"][0]["metadata"];
    (
        md["query"].as_str().expect("query").to_string(),
        md["threshold"].as_str().expect("threshold").parse().expect("number"),
    )
}

/// The query's value now, or `None` when it returns nothing.
async fn value(prom: &Prometheus, q: &str) -> Option<f64> {
    let r = prom.query(q).await;
    r.first().and_then(|s| s["value"][1].as_str()).and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scaling_query_tracks_offered_load_and_is_empty_without_fresh_data() {
    let (query, threshold) = trigger();
    // A plain scrape has no namespace label: match the empty one, as the dashboard tests do.
    let q = query.replace("namespace=\"llm-load-controller\"", "namespace=\"\"");
    let pool =
        regex::Regex::new(r#"pool="([^"]+)""#).expect("regex").captures(&q).expect("a pool")[1].to_string();

    let targets = [MetricsTarget::vllm(0.0, 2.0, 0.1).await, MetricsTarget::vllm(0.0, 3.0, 0.15).await];
    let tmp = tempfile::tempdir().expect("tmp");
    let listen = ports::free_port();
    let cfg = tmp.path().join("c.yaml");
    let list = targets.iter().map(|t| format!("'{}'", t.member())).collect::<Vec<_>>().join(", ");
    std::fs::write(
        &cfg,
        format!(
            "interval: 300ms\nlisten: 127.0.0.1:{listen}\nsources:\n  direct: {{ kind: scrape }}\n\
             pools:\n  - name: {pool}\n    source: direct\n    stale_after: 2s\n    members: {{ static: [{list}] }}\n"
        ),
    )
    .expect("config");
    let p = Proc::start(&cfg, listen, &[], &tmp.path().join("log"));
    wait::http_ok(&format!("http://127.0.0.1:{listen}/readyz"), Duration::from_secs(10)).await;
    let prom = Prometheus::start("llm-load-controller", &[format!("127.0.0.1:{listen}")]).await;

    // Idle: well under the threshold; the HPA's desired = ceil(replicas * value / threshold) stays put.
    let idle = wait::until(Duration::from_secs(30), "the idle saturation", || async {
        value(&prom, &q).await.filter(|v| *v < 0.3)
    })
    .await;
    let replicas = 4.0_f64;
    assert!((replicas * idle / threshold).ceil() <= replicas, "idle {idle} would scale up");

    // Busy: full KV caches and queues on both servers: saturation 1, past the threshold.
    for t in &targets {
        t.set(&vllm_text(80.0, 60.0, 0.95));
    }
    let busy = wait::until(Duration::from_secs(30), "the busy saturation", || async {
        value(&prom, &q).await.filter(|v| *v > threshold)
    })
    .await;
    assert!(busy <= 1.0, "saturation is capped at 1: {busy}");
    let desired = (replicas * busy / threshold).ceil();
    assert!(desired > replicas, "busy {busy}: the HPA would want {desired} of {replicas}");

    // No fresh data (the servers stop exposing metrics): the query goes empty, not to 0.
    for t in &targets {
        t.set("");
    }
    wait::until(Duration::from_secs(30), "the query to go empty", || async {
        value(&prom, &q).await.is_none().then_some(())
    })
    .await;
    let raw = prom.query(&format!("llmlc_pool_saturation_ratio{{pool=\"{pool}\"}}")).await;
    assert!(
        !raw.is_empty(),
        "the raw gauge still holds its last value; only the pool_up guard empties the query"
    );
    drop(p);
}
