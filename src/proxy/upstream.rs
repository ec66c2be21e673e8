//! Forwarding one request to one member, with the proxy's timeouts, and streaming the answer back
//! without buffering.
//!
//! Connections are our own (not reqwest's or hyper's client), pooled and driven by the request that
//! uses them ([`super::members`]): the member URIs are built once at load ([`member_uri`]), so a
//! request costs no URL parsing, headers move across without conversion, and the events of a stream
//! that arrive together leave together.
//!
//! - connect: the connector's timeout; a refused or timed-out connect is [`ForwardError::Connect`],
//!   which the caller retries on another member (nothing has reached the client yet).
//! - first byte: from sending the request to the first chunk of the response body. The response
//!   head is held until that chunk arrives, so a member that accepts but never answers gets a clean
//!   504 instead of a 200 with an empty body.
//! - idle: longest silence between two body chunks once streaming; past it the body ends with an
//!   error (the client sees a broken chunked response, the honest signal mid-stream).
//!
//! Each chunk is handed to the client as soon as it arrives (SSE tokens included). A non-streamed
//! answer keeps the member's `Content-Length`; one the member sent chunked (no length) and that is
//! not an event stream is collected (up to [`MAX_COLLECT`]) so the client gets a length too.
//! Dropping the returned stream (the client went away) drops the upstream response, which closes
//! the upstream connection; vLLM aborts a request whose connection closes.

use std::pin::Pin;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use futures::{Stream, StreamExt};
use std::future::Future as _;
use std::sync::Arc;

use super::config::Timeouts;
use super::errors::error_chain;
use super::members::{Members, SendError};

/// Headers that belong to one connection, never forwarded (RFC 9110 §7.6.1), plus `host` (the
/// client sets the member's).
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
];

/// Largest chunked non-streamed answer collected to give it a `Content-Length`; past it the rest
/// streams on (chunked).
pub const MAX_COLLECT: usize = 8 << 20;

pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(&name.as_str())
}

/// `http://host:port/path` for a member (IPv6 hosts get their brackets back).
pub fn member_uri(member: &llm_lc_adapters::MemberId, path: &str) -> Result<Uri, String> {
    let base = match member.host_port() {
        Some((h, p)) if h.contains(':') => format!("http://[{h}]:{p}"),
        Some((h, p)) => format!("http://{h}:{p}"),
        None => format!("http://{member}"),
    };
    format!("{base}{path}").parse::<Uri>().map_err(|e| format!("member {member}: not a URI: {e}"))
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
    members: Arc<Members>,
    /// For the rare calls that are not forwarding (members' `/v1/models`, polling, guards).
    reqwest: reqwest::Client,
    timeouts: Timeouts,
}

impl Upstream {
    pub fn new(timeouts: &Timeouts) -> Result<Upstream, String> {
        let reqwest = reqwest::Client::builder()
            .connect_timeout(timeouts.connect)
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(60))
            // Members are addressed directly; an HTTP_PROXY in the environment must not capture them.
            .no_proxy()
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Upstream { members: Members::new(timeouts.connect), reqwest, timeouts: timeouts.clone() })
    }

    pub fn client(&self) -> &reqwest::Client {
        &self.reqwest
    }

    /// POST `body` to `uri` and wait for the first body chunk.
    pub async fn send(&self, uri: &Uri, headers: &HeaderMap, body: Bytes) -> Result<Started, ForwardError> {
        let mut out = HeaderMap::with_capacity(headers.len());
        for (k, v) in headers {
            // The body may have been rewritten (model split): the length is set from it.
            if !is_hop_by_hop(k) && k != header::CONTENT_LENGTH {
                out.append(k.clone(), v.clone());
            }
        }
        let deadline = tokio::time::Instant::now() + self.timeouts.first_byte;
        let resp = match tokio::time::timeout_at(deadline, self.members.send(uri, &out, body)).await {
            Err(_) => return Err(ForwardError::FirstByteTimeout(self.timeouts.first_byte)),
            Ok(Err(SendError::Connect(e))) => return Err(ForwardError::Connect(e)),
            Ok(Err(SendError::Failed(e))) => {
                return Err(ForwardError::Broken(format!("request failed: {e}")))
            }
            Ok(Ok(r)) => r,
        };
        let (parts, mut upstream) = resp.into_parts();
        let status = parts.status;
        let mut headers = parts.headers;
        for h in HOP_BY_HOP {
            headers.remove(*h);
        }
        let streamed = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("text/event-stream"));
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
        let Some(first) = first else {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
            return Ok(Started { status, headers, first_at, body: Box::pin(futures::stream::empty()) });
        };
        if !streamed && !headers.contains_key(header::CONTENT_LENGTH) {
            // A whole answer sent chunked: collect it so the client gets a Content-Length.
            let mut buf = first.to_vec();
            loop {
                match tokio::time::timeout(idle, upstream.next()).await {
                    Ok(Some(Ok(b))) => {
                        buf.extend_from_slice(&b);
                        if buf.len() > MAX_COLLECT {
                            let head = futures::stream::once(async move { Ok(Bytes::from(buf)) });
                            let body: BodyStream = Box::pin(head.chain(rest_of(upstream, idle)));
                            return Ok(Started { status, headers, first_at, body });
                        }
                    }
                    Ok(Some(Err(e))) => {
                        return Err(ForwardError::Broken(format!("upstream broke: {}", error_chain(&e))))
                    }
                    Ok(None) => break,
                    Err(_) => {
                        return Err(ForwardError::Broken(format!(
                            "upstream silent for longer than the idle timeout of {idle:?}"
                        )))
                    }
                }
            }
            if let Ok(v) = HeaderValue::from_str(&buf.len().to_string()) {
                headers.insert(header::CONTENT_LENGTH, v);
            }
            let whole = Bytes::from(buf);
            return Ok(Started {
                status,
                headers,
                first_at,
                body: Box::pin(futures::stream::once(async move { Ok(whole) })),
            });
        }
        let body: BodyStream =
            Box::pin(futures::stream::once(async move { Ok(first) }).chain(rest_of(upstream, idle)));
        Ok(Started { status, headers, first_at, body })
    }
}

/// Largest piece handed on at once when several upstream chunks are already waiting.
const MAX_PIECE: usize = 64 << 10;

/// The rest of an upstream body, forwarded without waiting for anything: each poll hands on
/// everything that has already arrived (so a client that fell behind gets one write instead of
/// hundreds, as HAProxy does), and never holds a chunk back to wait for more. The idle timeout runs
/// only while nothing is available; one timer per stream, reset rather than rebuilt.
fn rest_of<S, E>(upstream: S, idle: Duration) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: std::error::Error + Send + 'static,
{
    Forward { inner: upstream, idle, timer: None, armed: false, done: false, failed: None }
}

struct Forward<S> {
    inner: S,
    idle: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The timer counts from the last time data arrived.
    armed: bool,
    done: bool,
    /// An error that came after data that was handed on first.
    failed: Option<std::io::Error>,
}

impl<S, E> Stream for Forward<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::error::Error,
{
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = &mut *self;
        if let Some(e) = this.failed.take() {
            this.done = true;
            return Poll::Ready(Some(Err(e)));
        }
        if this.done {
            return Poll::Ready(None);
        }
        let mut first: Option<Bytes> = None;
        let mut more: Option<Vec<u8>> = None;
        let mut len = 0;
        while len < MAX_PIECE {
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(b))) => {
                    if b.is_empty() {
                        continue;
                    }
                    len += b.len();
                    match (&first, &mut more) {
                        (None, _) => first = Some(b),
                        (Some(f), None) => {
                            let mut m = Vec::with_capacity((2 * len).min(MAX_PIECE + b.len()));
                            m.extend_from_slice(f);
                            m.extend_from_slice(&b);
                            more = Some(m);
                        }
                        (Some(_), Some(m)) => m.extend_from_slice(&b),
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let e = std::io::Error::other(format!("upstream broke: {}", error_chain(&e)));
                    if first.is_none() {
                        this.done = true;
                        return Poll::Ready(Some(Err(e)));
                    }
                    this.failed = Some(e);
                    break;
                }
                Poll::Ready(None) => {
                    this.done = true;
                    break;
                }
                Poll::Pending => break,
            }
        }
        if let Some(f) = first {
            this.armed = false;
            return Poll::Ready(Some(Ok(more.map_or(f, Bytes::from))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        // Nothing has arrived: the idle timeout runs.
        if !this.armed {
            // Read the clock only when the silence starts, not on every wake-up.
            let deadline = tokio::time::Instant::now() + this.idle;
            match &mut this.timer {
                Some(t) => t.as_mut().reset(deadline),
                None => this.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
            this.armed = true;
        }
        let Some(timer) = this.timer.as_mut() else { return Poll::Pending };
        if timer.as_mut().poll(cx).is_ready() {
            this.done = true;
            let idle = this.idle;
            return Poll::Ready(Some(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("upstream silent for longer than the idle timeout of {idle:?}"),
            ))));
        }
        Poll::Pending
    }
}
