//! `kube`: a small client for the four calls the controller makes to the Kubernetes API: the
//! Lease's get, create and update (leader election, [`crate::leader`]) and the list of a Service's
//! EndpointSlices (members from Kubernetes, [`crate::source::kubernetes`]).
//!
//! Plain HTTPS against the API server with the pod's service-account token, rather than a full
//! Kubernetes client library: four calls do not justify kube-rs's dependency tree and build time
//! (measured in docs/configuration.md, "Members from Kubernetes").
//! The token file is re-read before every call, because projected service-account tokens are
//! rotated by the kubelet while the pod runs.

use std::path::Path;
use std::time::Duration;

use llm_lc_adapters::SecretRef;
use reqwest::StatusCode;

use crate::leader::lease::Lease;

/// Where a pod finds its service account: token, CA bundle and namespace.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 409: someone else wrote the Lease since we read it (or created it first).
    #[error("conflict: {0}")]
    Conflict(String),
    #[error(
        "the API server refused the service-account token ({0}); check that the token file is mounted \
         (automountServiceAccountToken) and not expired"
    )]
    Unauthorized(String),
    #[error(
        "not allowed: {0}; grant the service account what deploy/openshift/base/rbac.yaml grants: get, create \
         and update on leases.coordination.k8s.io (leader election), list on endpointslices.discovery.k8s.io \
         in the members' namespace (members from Kubernetes)"
    )]
    Forbidden(String),
    #[error("the API server answered {code}: {message}")]
    Status { code: u16, message: String },
    #[error("cannot reach the API server at {url}: {detail}")]
    Transport { url: String, detail: String },
    #[error("unexpected answer from the API server: {0}")]
    Decode(String),
    #[error("{0}")]
    Config(String),
}

/// Talks to one API server as one identity.
#[derive(Clone)]
pub struct KubeApi {
    base: String,
    http: reqwest::Client,
    token: Option<SecretRef>,
}

impl KubeApi {
    /// `base` like `https://172.30.0.1:443`; `ca_pem` added to the trusted roots; `token` sent as a
    /// bearer token (resolved before each call). `timeout` bounds each call.
    pub fn new(
        base: &str,
        token: Option<SecretRef>,
        ca_pem: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<KubeApi, ApiError> {
        let url = url::Url::parse(base)
            .map_err(|e| ApiError::Config(format!("API server URL {base:?} is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ApiError::Config(format!("API server URL {base:?} must be http or https")));
        }
        let mut b = llm_lc_adapters::tls::client_builder(timeout, None, false).map_err(ApiError::Config)?;
        if let Some(pem) = ca_pem {
            b = llm_lc_adapters::tls::with_roots(b, pem)
                .map_err(|e| ApiError::Config(format!("the API server CA bundle: {e}")))?;
        }
        let http = b.build().map_err(|e| ApiError::Config(format!("cannot build the HTTP client: {e}")))?;
        Ok(KubeApi { base: base.trim_end_matches('/').to_string(), http, token })
    }

    /// The in-cluster API server from `KUBERNETES_SERVICE_HOST`/`_PORT`, or `None` outside a pod.
    pub fn in_cluster_url() -> Option<String> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST").ok().filter(|h| !h.is_empty())?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").ok().filter(|p| !p.is_empty())?;
        let host = if host.contains(':') { format!("[{host}]") } else { host };
        Some(format!("https://{host}:{port}"))
    }

    /// Read a CA bundle file, with a message that says which file.
    pub fn read_ca(path: &Path) -> Result<Vec<u8>, ApiError> {
        std::fs::read(path)
            .map_err(|e| ApiError::Config(format!("cannot read CA file {}: {e}", path.display())))
    }

    fn lease_url(&self, namespace: &str, name: Option<&str>) -> String {
        let mut u = format!("{}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases", self.base);
        if let Some(n) = name {
            u.push('/');
            u.push_str(n);
        }
        u
    }

    async fn send(&self, req: reqwest::RequestBuilder, url: &str) -> Result<reqwest::Response, ApiError> {
        let req = match &self.token {
            Some(t) => {
                let token = t.resolve().map_err(ApiError::Config)?;
                req.bearer_auth(token)
            }
            None => req,
        };
        req.header("Accept", "application/json")
            .send()
            .await
            .map_err(|e| ApiError::Transport { url: url.to_string(), detail: error_chain(&e) })
    }

    /// The Lease, or `None` when it does not exist yet.
    pub async fn get(&self, namespace: &str, name: &str) -> Result<Option<Lease>, ApiError> {
        let url = self.lease_url(namespace, Some(name));
        let resp = self.send(self.http.get(&url), &url).await?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        decode(resp).await.map(Some)
    }

    /// Create the Lease; `Conflict` when it already exists.
    pub async fn create(&self, lease: &Lease) -> Result<Lease, ApiError> {
        let ns = lease.metadata.namespace.as_deref().unwrap_or_default();
        let url = self.lease_url(ns, None);
        decode(self.send(self.http.post(&url).json(lease), &url).await?).await
    }

    /// `GET` a path of the API (with its query), decoded as `T`; errors as for the Lease calls.
    pub async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        path_and_query: &str,
    ) -> Result<T, ApiError> {
        let url = format!("{}{path_and_query}", self.base);
        decode(self.send(self.http.get(&url), &url).await?).await
    }

    /// Replace the Lease. It must carry the `resourceVersion` it was read with; `Conflict` when the
    /// Lease changed since.
    pub async fn update(&self, lease: &Lease) -> Result<Lease, ApiError> {
        let ns = lease.metadata.namespace.as_deref().unwrap_or_default();
        let url = self.lease_url(ns, Some(&lease.metadata.name));
        decode(self.send(self.http.put(&url).json(lease), &url).await?).await
    }
}

/// A 2xx body as a `T`, or the `Status` the API server sent as an error.
async fn decode<T: serde::de::DeserializeOwned>(resp: reqwest::Response) -> Result<T, ApiError> {
    let code = resp.status();
    let body = resp.text().await.map_err(|e| ApiError::Decode(format!("reading the body: {e}")))?;
    if code.is_success() {
        return serde_json::from_str(&body)
            .map_err(|e| ApiError::Decode(format!("{e} in {}", snippet(&body))));
    }
    // Errors come as a `Status` object: {"kind":"Status","message":...,"reason":"Conflict","code":409}.
    let message = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_string))
        .unwrap_or_else(|| snippet(&body));
    Err(match code {
        StatusCode::CONFLICT => ApiError::Conflict(message),
        StatusCode::UNAUTHORIZED => ApiError::Unauthorized(message),
        StatusCode::FORBIDDEN => ApiError::Forbidden(message),
        c => ApiError::Status { code: c.as_u16(), message },
    })
}

fn snippet(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// reqwest's top-level message hides the cause (refused, TLS, DNS); print the whole chain.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
