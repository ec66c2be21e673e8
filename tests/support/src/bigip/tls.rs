//! HTTPS for the double, like a BIG-IP management port: a test CA and a server certificate for
//! 127.0.0.1 made with the `openssl` command line, and a rustls listener serving the same router.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// PEM files of a throwaway CA and a server certificate it signed for `127.0.0.1` and `localhost`.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA certificate: what a client passes as its CA bundle.
    pub ca_cert: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

impl TlsFiles {
    /// Generate into `dir` (a temp dir the test owns). Panics with the command's output if `openssl`
    /// is missing or fails.
    pub fn generate(dir: &Path) -> TlsFiles {
        let p = |n: &str| dir.join(n);
        let ext = p("server.ext");
        std::fs::write(&ext, "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n")
            .expect("write openssl extension file");
        let s = |x: &PathBuf| x.to_string_lossy().into_owned();
        let steps: [Vec<String>; 3] = [
            [
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=BIG-IP double test CA",
            ]
            .iter()
            .map(|a| a.to_string())
            .chain(["-keyout".into(), s(&p("ca.key")), "-out".into(), s(&p("ca.crt"))])
            .collect(),
            [
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-subj",
                "/CN=bigip-double",
            ]
            .iter()
            .map(|a| a.to_string())
            .chain(["-keyout".into(), s(&p("server.key")), "-out".into(), s(&p("server.csr"))])
            .collect(),
            ["x509", "-req", "-days", "2", "-set_serial", "2"]
                .iter()
                .map(|a| a.to_string())
                .chain([
                    "-in".into(),
                    s(&p("server.csr")),
                    "-CA".into(),
                    s(&p("ca.crt")),
                    "-CAkey".into(),
                    s(&p("ca.key")),
                    "-extfile".into(),
                    s(&ext),
                    "-out".into(),
                    s(&p("server.crt")),
                ])
                .collect(),
        ];
        for args in steps {
            let out = Command::new("openssl")
                .args(&args)
                .output()
                .expect("run openssl (install the openssl package)");
            assert!(
                out.status.success(),
                "openssl {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        TlsFiles { ca_cert: p("ca.crt"), server_cert: p("server.crt"), server_key: p("server.key") }
    }

    /// A self-signed certificate as a BIG-IP makes for its management port, made the way
    /// `openssl req -x509` does by default: marked as a CA, named `localhost.localdomain`, no
    /// subject alternative name for the address clients use. `ca_cert` is the certificate itself.
    pub fn self_signed(dir: &Path, name: &str) -> TlsFiles {
        let cert = dir.join(format!("{name}.crt"));
        let key = dir.join(format!("{name}.key"));
        let out = Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"])
            .args(["-days", "2", "-subj", "/CN=localhost.localdomain", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("run openssl (install the openssl package)");
        assert!(out.status.success(), "openssl req -x509 failed: {}", String::from_utf8_lossy(&out.stderr));
        TlsFiles { ca_cert: cert.clone(), server_cert: cert, server_key: key }
    }

    fn server_config(&self) -> Arc<ServerConfig> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.server_cert)
            .and_then(|it| it.collect::<Result<_, _>>())
            .expect("read server certificate PEM");
        let key = PrivateKeyDer::from_pem_file(&self.server_key).expect("read server key PEM");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cfg = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("certificate and key match");
        Arc::new(cfg)
    }
}

/// Accept TLS connections on `listener` and serve `app` on each, until the task is aborted.
pub async fn serve(listener: tokio::net::TcpListener, app: Router, files: &TlsFiles) {
    let acceptor = TlsAcceptor::from(files.server_config());
    loop {
        let Ok((tcp, _)) = listener.accept().await else { continue };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            // A client that refuses our certificate ends the handshake; that is a normal outcome in
            // tests of certificate verification.
            let Ok(tls) = acceptor.accept(tcp).await else { return };
            let svc = TowerToHyperService::new(app);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), svc).await;
        });
    }
}
