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
        labels: None,
        slots: Default::default(),
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

/// Every query answers per member; `timestamp()` answers `ts`.
async fn mount_with_timestamp(server: &MockServer, ts: &str) {
    let q = |signal: &str| {
        pool().queries.into_iter().find(|(s, _)| s.as_str() == signal).map(|(_, q)| q).expect("query")
    };
    Mock::given(query_param("query", q("timestamp")))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(vector(&[("10.0.0.1:8000", ts), ("10.0.0.2:8000", "1700000000")])),
        )
        .mount(server)
        .await;
    Mock::given(path("/api/v1/query"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(vector(&[("10.0.0.1:8000", "0.5"), ("10.0.0.2:8000", "0.25")])),
        )
        .mount(server)
        .await;
}

/// `timestamp()` answers of -Inf panicked the controller (Duration::from_secs_f64); NaN, +Inf and
/// future ones counted as fresh. Now each makes that member's sample invalid, and only that one.
#[tokio::test]
async fn non_finite_or_future_timestamps_invalidate_the_sample_never_panic() {
    let future = format!(
        "{}",
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs() + 3600
    );
    for (ts, reason) in [
        ("-Inf", "timestamp_not_finite"),
        ("+Inf", "timestamp_not_finite"),
        ("NaN", "timestamp_not_finite"),
        ("-1.9e19", ""),
        (future.as_str(), "timestamp_in_future"),
    ] {
        let server = MockServer::start().await;
        mount_with_timestamp(&server, ts).await;
        let snap = source(&server.uri()).sample(&[&pool()]).await.remove(0).expect("sampled");
        let other =
            snap.members[&MemberId::from("10.0.0.2:8000")].as_ref().expect("the other member is fine");
        assert!(other.age > Duration::from_secs(1000), "its 1700000000 stamp is old");
        let first = &snap.members[&MemberId::from("10.0.0.1:8000")];
        if reason.is_empty() {
            // Absurdly old: a sample, but stale beyond any stale_after.
            assert!(first.as_ref().expect("old sample").age > Duration::from_secs(365 * 86400), "{ts}");
            continue;
        }
        assert!(first.is_none(), "{ts}: an untrustworthy timestamp gives no sample");
        assert!(snap.rejected.iter().any(|r| r.reason == reason), "{ts}: {:?}", snap.rejected);
        assert_eq!(snap.failures.len(), 1, "{ts}: {:?}", snap.failures);
        assert_eq!(snap.failures[0].reason.as_str(), "bad_timestamp");
    }
}

#[tokio::test]
async fn http_errors_are_http_errors_whatever_the_body() {
    for (status, body) in [
        (500, "<html>Internal Server Error</html>".to_string()),
        (503, json!({"status": "error", "errorType": "timeout", "error": "query timed out"}).to_string()),
        (502, String::new()),
    ] {
        let server = MockServer::start().await;
        Mock::given(path("/api/v1/query"))
            .respond_with(ResponseTemplate::new(status).set_body_string(body.clone()))
            .mount(&server)
            .await;
        let e = source(&server.uri()).sample(&[&pool()]).await.remove(0).expect_err("must fail");
        match &e {
            SourceError::Http { status: s, .. } if *s == status => {}
            other => panic!("{status} {body:?}: {other:?}"),
        }
        assert_eq!(e.reason(), "http");
    }
    // A bad query (400 with Prometheus' JSON error) is the query's fault.
    let server = MockServer::start().await;
    Mock::given(path("/api/v1/query"))
        .respond_with(ResponseTemplate::new(400).set_body_json(
            json!({"status": "error", "errorType": "bad_data", "error": "parse error at char 3"}),
        ))
        .mount(&server)
        .await;
    let e = source(&server.uri()).sample(&[&pool()]).await.remove(0).expect_err("must fail");
    assert!(matches!(&e, SourceError::Query { detail, .. } if detail.contains("parse error")), "{e:?}");
}

/// Thanos Querier's tenancy port (9092) answers only with `?namespace=`; a proxy here plays it and
/// refuses any query without it, the way kube-rbac-proxy + prom-label-proxy do.
#[tokio::test]
async fn source_url_query_parameters_are_kept_on_every_query() {
    let server = MockServer::start().await;
    Mock::given(path("/api/v1/query"))
        .and(query_param("namespace", "llm"))
        .and(query_param("query", "up{job=\"vllm\"}"))
        .respond_with(ResponseTemplate::new(200).set_body_json(vector(&[("10.0.0.1:8000", "1")])))
        .mount(&server)
        .await;
    Mock::given(path("/api/v1/query"))
        .and(query_param("namespace", "llm"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(vector(&[("10.0.0.1:8000", "0.5"), ("10.0.0.2:8000", "0.25")])),
        )
        .mount(&server)
        .await;
    Mock::given(path("/api/v1/query"))
        .respond_with(
            ResponseTemplate::new(400)
                .set_body_string("Bad Request. The request or configuration is malformed: missing namespace"),
        )
        .mount(&server)
        .await;
    let src = source(&format!("{}/?namespace=llm", server.uri()));
    let snap = src.sample(&[&pool()]).await.remove(0).expect("tenancy query answered");
    assert!(snap.members.values().all(|s| s.is_some()), "{snap:?}");
    let members = src
        .discover("{job=\"vllm\"}", &Join::new(&JoinConfig::default()).expect("join"))
        .await
        .expect("discover");
    assert_eq!(members, vec![MemberId::from("10.0.0.1:8000")]);
    // Without the parameter the proxy refuses: an HTTP error, not "malformed".
    let e = source(&server.uri()).sample(&[&pool()]).await.remove(0).expect_err("refused");
    assert!(matches!(e, SourceError::Http { status: 400, .. }), "{e:?}");
    for r in server.received_requests().await.unwrap_or_default() {
        assert!(r.url.path() == "/api/v1/query", "{}", r.url);
    }
}

/// A static member Prometheus has no series for is reported, not silently left without data.
#[tokio::test]
async fn members_without_series_are_reported() {
    let server = MockServer::start().await;
    Mock::given(path("/api/v1/query"))
        .respond_with(ResponseTemplate::new(200).set_body_json(vector(&[("10.0.0.1:8000", "1")])))
        .mount(&server)
        .await;
    let snap = source(&server.uri()).sample(&[&pool()]).await.remove(0).expect("sampled");
    let got: Vec<_> = snap.failures.iter().map(|f| (f.member.as_str(), f.reason.as_str())).collect();
    assert_eq!(got, vec![("10.0.0.2:8000", "no_series")]);
}
