//! The one place HTTP clients get their TLS trust: a CA bundle (every certificate in it), or
//! verification switched off on explicit request. Used by the sinks here and by the controller's
//! sources and Kubernetes client, so a CA file means the same everywhere.

use std::path::Path;
use std::time::Duration;

/// A client builder with `timeout` (whole request and connect) and the trust `ca_file` gives:
/// every certificate of the PEM bundle is a root (an OpenShift service CA bundle holds several).
/// `insecure` turns verification off; callers warn about it where they know the target.
pub fn client_builder(
    timeout: Duration,
    ca_file: Option<&Path>,
    insecure: bool,
) -> Result<reqwest::ClientBuilder, String> {
    let mut b = reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout)
        .user_agent(concat!("llm-load-controller/", env!("CARGO_PKG_VERSION")));
    if let Some(ca) = ca_file {
        let pem = std::fs::read(ca).map_err(|e| format!("cannot read CA file {}: {e}", ca.display()))?;
        b = with_roots(b, &pem).map_err(|e| format!("CA file {}: {e}", ca.display()))?;
    }
    if insecure {
        b = b.danger_accept_invalid_certs(true);
    }
    Ok(b)
}

/// Add every certificate of a PEM bundle as a trusted root.
pub fn with_roots(mut b: reqwest::ClientBuilder, pem: &[u8]) -> Result<reqwest::ClientBuilder, String> {
    let certs = reqwest::Certificate::from_pem_bundle(pem).map_err(|e| format!("not a PEM bundle: {e}"))?;
    if certs.is_empty() {
        return Err("holds no certificate".into());
    }
    for c in certs {
        b = b.add_root_certificate(c);
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_empty_ca_file_is_a_clear_error() {
        let e = client_builder(Duration::from_secs(1), Some(Path::new("/no/such/ca.pem")), false)
            .expect_err("missing file");
        assert!(e.contains("cannot read CA file /no/such/ca.pem"), "{e}");
        let dir = tempfile::tempdir().expect("tmp");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").expect("write");
        let e = client_builder(Duration::from_secs(1), Some(&empty), false).expect_err("no certs");
        assert!(e.contains("holds no certificate"), "{e}");
    }
}
