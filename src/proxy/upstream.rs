//! Forwarding one request to one member, with the proxy's timeouts, and streaming the answer back
//! without buffering.
//!
//! - connect: reqwest's connect timeout; a refused or timed-out connect is [`ForwardError::Connect`],
//!   which the caller retries on another member (nothing has reached the client yet).
//! - first byte: from sending the request to the first chunk of the response body. The response
//!   head is held until that chunk arrives, so a member that accepts but never answers gets a clean
//!   504 instead of a 200 with an empty body.
//! - idle: longest silence between two body chunks once streaming; past it the body ends with an
//!   error (the client sees a broken chunked response, the honest signal mid-stream).
//!
//! Each chunk is handed to the client as soon as it arrives (SSE tokens included). Dropping the
//! returned stream (the client went away) drops the upstream response, which closes the upstream
//! connection; vLLM aborts a request whose connection closes.

use std::pin::Pin;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use futures::{Stream, StreamExt};

use super::config::Timeouts;

/// Headers that belong to one connection, never forwarded (RFC 9110 §7.6.1), plus those the proxy
/// sets itself.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
];

pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(&name.as_str())
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("no response within the first-byte timeout of {0:?}")]
    FirstByteTimeout(Duration),
    #[error("{0}")]
    Broken(String),
}

pub type BodyStream = Pin<Box<dyn Stream<Item = Result<Bytes, std::io::Error>> + Send>>;

/// A response whose head and first body chunk have arrived.
pub struct Started {
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// When the first body byte arrived (for TTFT).
    pub first_at: Instant,
    /// The whole body, first chunk included, with the idle timeout applied.
    pub body: BodyStream,
}

#[derive(Clone)]
pub struct Upstream {
    client: reqwest::Client,
    timeouts: Timeouts,
}

impl Upstream {
    pub fn new(timeouts: &Timeouts) -> Result<Upstream, String> {
        let client = reqwest::Client::builder()
            .connect_timeout(timeouts.connect)
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(60))
            // Members are addressed directly; an HTTP_PROXY in the environment must not capture them.
            .no_proxy()
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Upstream { client, timeouts: timeouts.clone() })
    }

    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// POST `body` to `base` + `path` and wait for the first body chunk.
    pub async fn send(
        &self,
        base: &str,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Started, ForwardError> {
        let mut out = reqwest::header::HeaderMap::new();
        for (k, v) in headers {
            if !is_hop_by_hop(k) {
                out.append(k.clone(), v.clone());
            }
        }
        let deadline = tokio::time::Instant::now() + self.timeouts.first_byte;
        let req = self.client.post(format!("{base}{path}")).headers(out).body(body);
        let resp = match tokio::time::timeout_at(deadline, req.send()).await {
            Err(_) => return Err(ForwardError::FirstByteTimeout(self.timeouts.first_byte)),
            Ok(Err(e)) if e.is_connect() => return Err(ForwardError::Connect(error_chain(&e))),
            Ok(Err(e)) => return Err(ForwardError::Broken(format!("request failed: {}", error_chain(&e)))),
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        let mut headers = HeaderMap::new();
        for (k, v) in resp.headers() {
            if !is_hop_by_hop(k) {
                headers.append(k.clone(), v.clone());
            }
        }
        let mut upstream = resp.bytes_stream();
        // Skip empty chunks: they carry nothing a client could use.
        let first = loop {
            match tokio::time::timeout_at(deadline, upstream.next()).await {
                Err(_) => return Err(ForwardError::FirstByteTimeout(self.timeouts.first_byte)),
                Ok(Some(Ok(b))) if b.is_empty() => continue,
                Ok(Some(Ok(b))) => break Some(b),
                Ok(Some(Err(e))) => {
                    return Err(ForwardError::Broken(format!(
                        "response broke before its first byte: {}",
                        error_chain(&e)
                    )))
                }
                Ok(None) => break None,
            }
        };
        let first_at = Instant::now();
        let idle = self.timeouts.idle;
        let rest = futures::stream::unfold(Some(upstream), move |st| async move {
            let mut s = st?;
            match tokio::time::timeout(idle, s.next()).await {
                Ok(Some(Ok(b))) => Some((Ok(b), Some(s))),
                Ok(Some(Err(e))) => {
                    Some((Err(std::io::Error::other(format!("upstream broke: {}", error_chain(&e)))), None))
                }
                Ok(None) => None,
                Err(_) => Some((
                    Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("upstream silent for longer than the idle timeout of {idle:?}"),
                    )),
                    None,
                )),
            }
        });
        let body: BodyStream = match first {
            Some(b) => Box::pin(futures::stream::once(async move { Ok(b) }).chain(rest)),
            None => Box::pin(futures::stream::empty()),
        };
        Ok(Started { status, headers, first_at, body })
    }
}

/// An error with its sources, one line ("connection refused" sits a few levels down in reqwest).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}
