//! The one place HTTP clients get their TLS trust: a CA bundle (every certificate in it), one pinned
//! certificate, or verification switched off on explicit request. Used by the sinks here and by the
//! controller's sources and Kubernetes client, so a CA file means the same everywhere.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// A client builder with `timeout` (whole request and connect) and the trust `ca_file` gives:
/// every certificate of the PEM bundle is a root (an OpenShift service CA bundle holds several).
/// `insecure` turns verification off; callers warn about it where they know the target.
pub fn client_builder(
    timeout: Duration,
    ca_file: Option<&Path>,
    insecure: bool,
) -> Result<reqwest::ClientBuilder, String> {
    let mut b = base(timeout);
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

/// Trust exactly the certificate in `pem_file` and nothing else.
///
/// What this is for: appliances (a BIG-IP's management port) that present a self-signed certificate
/// they made themselves. Such a certificate is usually marked as a CA (what `openssl req -x509` does
/// by default), which webpki refuses as a server certificate (`CaUsedAsEndEntity`), and it names the
/// device's default host name, not the address the controller uses. Comparing the presented
/// certificate byte for byte with the pinned one is a stronger check than chain and name
/// validation; the handshake signature is still verified, so only the holder of the key passes.
pub fn pinned_builder(timeout: Duration, pem_file: &Path) -> Result<reqwest::ClientBuilder, String> {
    let pinned = CertificateDer::from_pem_file(pem_file)
        .map_err(|e| format!("pinned certificate {}: not a PEM certificate: {e}", pem_file.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = Arc::new(Pinned { cert: pinned, provider: provider.clone() });
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(base(timeout).use_preconfigured_tls(config))
}

/// What every client of this project has: `timeout` for the whole request and for connecting, and
/// its name as user agent.
fn base(timeout: Duration) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout)
        .user_agent(concat!("llm-load-controller/", env!("CARGO_PKG_VERSION")))
}

#[derive(Debug)]
struct Pinned {
    cert: CertificateDer<'static>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.cert.as_ref() {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "the server's certificate is not the pinned certificate (pinned_cert); if the BIG-IP's \
                 certificate was renewed, update the file"
                    .into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
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
