//! TLS for the picker's gRPC doors (`picker.tls: {cert_file, key_file}`): the Inference
//! Extension's gateways can reach their endpoint picker over TLS (its reference picker serves a
//! self-signed certificate by default). The files are PEM; read once at start. HTTP/2 is offered
//! by ALPN, as gRPC needs.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// How long a client gets to finish its TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// The acceptor for a certificate chain and its key, or why not (the file and what is wrong).
pub fn acceptor(cert_file: &Path, key_file: &Path) -> Result<TlsAcceptor, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|e| format!("{}: {e}", cert_file.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in it", cert_file.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| format!("{}: {e}", key_file.display()))?;
    let mut cfg =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| format!("{} with {}: {e}", cert_file.display(), key_file.display()))?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}

/// Serve `app` over TLS on `listener` until `stop`.
pub async fn serve(listener: TcpListener, acceptor: TlsAcceptor, app: axum::Router, stop: CancellationToken) {
    loop {
        let tcp = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    tracing::warn!(error = %e, "picker door: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, app, stop) = (acceptor.clone(), app.clone(), stop.clone());
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                // A client that cannot speak TLS to us: nothing to serve.
                _ => return,
            };
            let service = TowerToHyperService::new(app);
            let builder = Builder::new(TokioExecutor::new());
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = conn => {}
            }
        });
    }
}
