//! TLS toward the BIG-IP: verification is on unless switched off, and a private CA is trusted through
//! `ca_file`. The double serves HTTPS with a certificate from a throwaway CA made by `openssl`.

use std::time::Duration;

use llm_lc_adapters::f5::{F5Config, F5Sink, Username};
use llm_lc_adapters::{MemberId, RatioSink, Ratios, SecretRef, SinkError};
use llm_lc_testkit::bigip::{BigIpDouble, DoubleConfig, MemberSpec, PoolSpec, Role, TlsFiles, UserSpec};

const POOL: &str = "/Common/llm_pool";

fn config(d: &BigIpDouble) -> F5Config {
    F5Config {
        timeout: Duration::from_secs(2),
        retries: 1,
        retry_backoff: Duration::from_millis(10),
        ..F5Config::new(&d.url(), POOL, Username::Plain("svc".into()), SecretRef::Value("pw".into()))
    }
}

fn want() -> Ratios {
    [(MemberId::from("10.0.0.1:8000"), 6)].into_iter().collect()
}

#[tokio::test]
async fn verification_is_on_by_default_and_a_ca_file_or_the_insecure_switch_passes() {
    let dir = tempfile::tempdir().unwrap();
    let files = TlsFiles::generate(dir.path());
    let d = BigIpDouble::start_tls(DoubleConfig::default(), &files).await;
    d.add_user(UserSpec::new("svc", "pw", Role::ApplicationEditor));
    d.add_pool(PoolSpec::new(POOL).mode("ratio-member").member(MemberSpec::ip("10.0.0.1", 8000)));
    assert!(d.url().starts_with("https://127.0.0.1:"));

    // Default: the private CA is unknown, so the connection is refused before any credential is sent.
    let err = F5Sink::new(&config(&d), "llm").unwrap().apply(&want()).await.unwrap_err();
    assert!(matches!(err, SinkError::Unreachable { .. }), "{err}");
    assert!(err.to_string().to_lowercase().contains("certificate"), "says why: {err}");
    assert!(d.requests().is_empty(), "no request reached the BIG-IP");

    // With the CA bundle, it verifies and works.
    let mut cfg = config(&d);
    cfg.ca_file = Some(files.ca_cert.clone());
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    sink.apply(&want()).await.unwrap();
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(6));
    sink.shutdown().await;

    // The explicit insecure switch also works (and logs a warning).
    let mut cfg = config(&d);
    cfg.insecure_skip_verify = true;
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    assert_eq!(sink.current().await.unwrap(), Some(want()));
    sink.shutdown().await;
}

#[tokio::test]
async fn unusable_ca_files_are_configuration_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = BigIpDouble::start().await;
    let mut cfg = config(&d);
    cfg.ca_file = Some(dir.path().join("missing.pem"));
    let err = F5Sink::new(&cfg, "llm").err().expect("missing CA file refused");
    assert!(matches!(err, SinkError::Config(_)) && err.to_string().contains("missing.pem"), "{err}");
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    cfg.ca_file = Some(junk);
    let err = F5Sink::new(&cfg, "llm").err().expect("junk CA file refused");
    assert!(matches!(err, SinkError::Config(_)), "{err}");
}

#[tokio::test]
async fn a_pinned_self_signed_certificate_is_trusted_and_any_other_refused() {
    // What a BIG-IP makes for itself: self-signed, marked as a CA, named localhost.localdomain.
    let dir = tempfile::tempdir().unwrap();
    let own = TlsFiles::self_signed(dir.path(), "bigip");
    let other = TlsFiles::self_signed(dir.path(), "impostor");
    let d = BigIpDouble::start_tls(DoubleConfig::default(), &own).await;
    d.add_user(UserSpec::new("svc", "pw", Role::ApplicationEditor));
    d.add_pool(PoolSpec::new(POOL).mode("ratio-member").member(MemberSpec::ip("10.0.0.1", 8000)));

    // As a CA file it cannot work (rustls: a CA certificate used as the server's, and the name does
    // not match): the error points at pinned_cert.
    let mut cfg = config(&d);
    cfg.ca_file = Some(own.server_cert.clone());
    let err = F5Sink::new(&cfg, "llm").unwrap().apply(&want()).await.unwrap_err();
    assert!(matches!(err, SinkError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains("pinned_cert"), "points at the fix: {err}");

    // Pinned, it works, although it names neither 127.0.0.1 nor a CA.
    let mut cfg = config(&d);
    cfg.pinned_cert = Some(own.server_cert.clone());
    let sink = F5Sink::new(&cfg, "llm").unwrap();
    sink.apply(&want()).await.unwrap();
    assert_eq!(d.ratio(POOL, "10.0.0.1:8000"), Some(6));
    sink.shutdown().await;

    // Another certificate pinned: refused before any credential leaves.
    d.clear_requests();
    let mut cfg = config(&d);
    cfg.pinned_cert = Some(other.server_cert.clone());
    let err = F5Sink::new(&cfg, "llm").unwrap().apply(&want()).await.unwrap_err();
    assert!(matches!(err, SinkError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains("not the pinned certificate"), "{err}");
    assert!(d.requests().is_empty(), "no request reached the BIG-IP");

    // Pinning and a CA file together is a configuration error, named.
    let mut cfg = config(&d);
    cfg.pinned_cert = Some(own.server_cert.clone());
    cfg.ca_file = Some(own.server_cert.clone());
    let err = F5Sink::new(&cfg, "llm").err().expect("contradiction refused");
    assert!(err.to_string().contains("pinned_cert"), "{err}");
}
