//! The Prometheus source when Prometheus misbehaves: HTTP 500, a timeout, malformed JSON, an empty
//! result, NaN values. wiremock plays Prometheus here because a real one cannot be made to fail on cue.

use std::time::Duration;

use llm_lc_adapters::MemberId;
use llm_load_controller::config::{JoinConfig, PrometheusConfig};
use llm_load_controller::source::profile::{promql, ProfileName, QueryOverrides};
use llm_load_controller::source::prometheus::PrometheusSource;
use llm_load_controller::source::{Join, PoolQuery, SourceError};
use serde_json::json;
use wiremock::matchers::{method, path, query_param};
use wiremock::{Mock, MockServer, ResponseTemplate};

fn source(url: &str) -> PrometheusSource {
    let cfg: PrometheusConfig =
        serde_yaml_ng::from_str(&format!("url: '{url}'\ntimeout: 500ms\n")).expect("config");
    PrometheusSource::new("test", &cfg).expect("source")
}

fn pool() -> PoolQuery {
    let names = ProfileName::Vllm.metric_names();
    PoolQuery {
        members: vec![MemberId::from("10.0.0.1:8000"), MemberId::from("10.0.0.2:8000")],
        queries: promql(&names, &QueryOverrides::default(), "instance", None, Duration::from_secs(60)),
        names,
        join: Join::new(&JoinConfig::default()).expect("join"),
    }
}

fn vector(rows: &[(&str, &str)]) -> serde_json::Value {
    json!({"status": "success", "data": {"resultType": "vector", "result":
        rows.iter().map(|(inst, v)| json!({"metric": {"instance": inst}, "value": [1700000000.0, v]})).collect::<Vec<_>>()}})
}

#[tokio::test]
async fn http_500_is_a_source_error() {
    let server = MockServer::start().await;
    Mock::given(path("/api/v1/query"))
        .respond_with(ResponseTemplate::new(500).set_body_string("boom"))
        .mount(&server)
        .await;
    let r = source(&server.uri()).sample(&[&pool()]).await.remove(0);
    let e = r.expect_err("500 must fail");
    assert!(matches!(e, SourceError::Http { status: 500, .. }), "{e:?}");
    // URLs can carry credentials; errors never repeat them.
    assert!(!e.to_string().contains("http://"), "{e}");
}

#[tokio::test]
async fn timeout_is_unreachable() {
    let server = MockServer::start().await;
    Mock::given(path("/api/v1/query"))
        .respond_with(ResponseTemplate::new(200).set_body_json(vector(&[])).set_delay(Duration::from_secs(3)))
        .mount(&server)
        .await;
    let started = std::time::Instant::now();
    let e = source(&server.uri()).sample(&[&pool()]).await.remove(0).expect_err("timeout");
    assert!(matches!(e, SourceError::Unreachable { .. }), "{e:?}");
    assert!(e.to_string().contains("timed out"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(2), "the configured 500ms timeout applies");
}

#[tokio::test]
async fn malformed_json_is_malformed() {
    let server = MockServer::start().await;
    Mock::given(path("/api/v1/query"))
        .respond_with(ResponseTemplate::new(200).set_body_string("{not json"))
        .mount(&server)
        .await;
    let e = source(&server.uri()).sample(&[&pool()]).await.remove(0).expect_err("malformed");
    assert!(matches!(e, SourceError::Malformed { .. } | SourceError::Unreachable { .. }), "{e:?}");
}

#[tokio::test]
async fn empty_result_means_no_data_not_zero() {
    let server = MockServer::start().await;
    Mock::given(path("/api/v1/query"))
        .respond_with(ResponseTemplate::new(200).set_body_json(vector(&[])))
        .mount(&server)
        .await;
    let snap = source(&server.uri()).sample(&[&pool()]).await.remove(0).expect("empty is not an error");
    assert_eq!(snap.members.len(), 2);
    assert!(snap.members.values().all(|s| s.is_none()), "{snap:?}");
}

#[tokio::test]
async fn nan_values_are_rejected_and_counted() {
    let server = MockServer::start().await;
    let q = |signal: &str| {
        pool().queries.into_iter().find(|(s, _)| s.as_str() == signal).map(|(_, q)| q).expect("query")
    };
    Mock::given(method("GET"))
        .and(query_param("query", q("waiting")))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(vector(&[("10.0.0.1:8000", "NaN"), ("10.0.0.2:8000", "2")])),
        )
        .mount(&server)
        .await;
    Mock::given(method("GET"))
        .and(query_param("query", q("running")))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(vector(&[("10.0.0.1:8000", "3"), ("10.0.0.2:8000", "4")])),
        )
        .mount(&server)
        .await;
    Mock::given(method("GET"))
        .and(query_param("query", q("kv_usage")))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(vector(&[("10.0.0.1:8000", "0.5"), ("10.0.0.2:8000", "+Inf")])),
        )
        .mount(&server)
        .await;
    Mock::given(path("/api/v1/query"))
        .respond_with(ResponseTemplate::new(200).set_body_json(vector(&[])))
        .mount(&server)
        .await;
    let snap = source(&server.uri()).sample(&[&pool()]).await.remove(0).expect("sampled");
    assert!(snap.members[&MemberId::from("10.0.0.1:8000")].is_none(), "NaN waiting");
    assert!(snap.members[&MemberId::from("10.0.0.2:8000")].is_none(), "Inf KV usage");
    let reasons: Vec<_> = snap.rejected.iter().map(|r| r.reason).collect();
    assert_eq!(reasons, vec!["nan", "infinite"]);
}

#[tokio::test]
async fn bearer_token_is_sent_from_a_file_and_rereads_rotation() {
    let server = MockServer::start().await;
    Mock::given(path("/api/v1/query"))
        .and(wiremock::matchers::header("authorization", "Bearer second"))
        .respond_with(ResponseTemplate::new(200).set_body_json(vector(&[("10.0.0.1:8000", "1")])))
        .mount(&server)
        .await;
    Mock::given(path("/api/v1/query")).respond_with(ResponseTemplate::new(401)).mount(&server).await;
    let dir = tempfile::tempdir().expect("tmp");
    let token = dir.path().join("token");
    std::fs::write(&token, "first\n").expect("write");
    let cfg: PrometheusConfig = serde_yaml_ng::from_str(&format!(
        "url: '{}'\nbearer_token: {{ file: '{}' }}\n",
        server.uri(),
        token.display()
    ))
    .expect("config");
    let src = PrometheusSource::new("t", &cfg).expect("source");
    assert!(src.sample(&[&pool()]).await.remove(0).is_err(), "old token refused");
    std::fs::write(&token, "second\n").expect("rotate");
    assert!(src.sample(&[&pool()]).await.remove(0).is_ok(), "rotated token is read on the next cycle");
}
