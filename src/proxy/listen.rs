//! Serving client connections with limits a hostile or careless client cannot outlast.
//!
//! `axum::serve` holds a connection for as long as the client keeps it open, even one that never
//! finishes its request head (slowloris): thousands of those exhaust the file descriptors. Here each
//! connection has a watchdog:
//! - until its first request head is complete, a connection lives at most `header_read`;
//! - between requests (keep-alive), at most `keep_alive_idle` — which also bounds a slow head on a
//!   reused connection;
//! - while a request is in progress (head read, response not yet fully written) there is no
//!   connection deadline: the upstream timeouts govern it.
//!
//! At most `max` connections are served at once; the next one is answered at once with a 503 and
//! an OpenAI-style JSON error (`too_many_connections`, `Retry-After: 1`) and closed, so a client
//! sees why instead of a hang. HTTP/1.1 only (what OpenAI clients and load testers speak).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use axum::Router;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::Service as _;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::errors::ProxyApiError;

/// Connection limits (from `limits.max_connections`, `timeouts.header_read`,
/// `timeouts.keep_alive_idle`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max: usize,
    pub header_read: Duration,
    pub keep_alive_idle: Duration,
}

/// Connection counters shared with `/metrics`.
#[derive(Clone, Default)]
pub struct ConnMetrics {
    pub open: Gauge,
    pub refused: Counter,
    pub timed_out: Counter,
}

/// Most refusals written at once; past that an over-limit connection is closed without a word
/// (a flood must not turn the refusals themselves into held connections).
const MAX_REFUSING: usize = 64;

/// Serve `app` on `listener` until `stop`; then stop accepting, let every connection finish its
/// response (idle ones close at once) and return.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    metrics: ConnMetrics,
    stop: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let mut conns = JoinSet::new();
    let mut last_accept_error: Option<String> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => {
                let tcp = match accepted {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        // Out of file descriptors and the like: say so once, back off a little
                        // instead of spinning, keep serving the connections already open.
                        let msg = e.to_string();
                        if last_accept_error.as_deref() != Some(msg.as_str()) {
                            tracing::warn!(error = %msg, "cannot accept a connection");
                            last_accept_error = Some(msg);
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                last_accept_error = None;
                match slots.clone().try_acquire_owned() {
                    Ok(slot) => {
                        let (app, metrics, stop) = (app.clone(), metrics.clone(), stop.clone());
                        conns.spawn(async move {
                            metrics.open.inc();
                            serve_conn(tcp, app, limits, &metrics, stop).await;
                            metrics.open.dec();
                            drop(slot);
                        });
                    }
                    Err(_) => {
                        metrics.refused.inc();
                        if let Ok(r) = refusing.clone().try_acquire_owned() {
                            conns.spawn(async move {
                                refuse(tcp, limits.max).await;
                                drop(r);
                            });
                        }
                    }
                }
            }
        }
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
}

/// When a connection was last busy, and whether a request is in progress.
struct Activity {
    born: Instant,
    /// Requests whose response has not been fully written (or dropped).
    active: AtomicUsize,
    /// Milliseconds after `born` when the last response ended; `u64::MAX` before any.
    last_end_ms: AtomicU64,
    /// Wakes the watchdog when a request starts or ends (its deadline moves).
    changed: tokio::sync::Notify,
}

impl Activity {
    /// When this connection may be closed if nothing starts before; `None` while busy.
    fn deadline(&self, limits: &ConnLimits) -> Option<Instant> {
        if self.active.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(match self.last_end_ms.load(Ordering::Acquire) {
            u64::MAX => self.born + limits.header_read,
            ms => self.born + Duration::from_millis(ms) + limits.keep_alive_idle,
        })
    }
}

/// Decrements `active` when the response body is done (written or dropped).
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        let ms = u64::try_from(self.0.born.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        self.0.last_end_ms.store(ms, Ordering::Release);
        self.0.active.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_one();
    }
}

/// A response body that marks the connection busy until it ends. The size hint is passed through,
/// so a body of known length keeps its `Content-Length`.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl HttpBody for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

async fn serve_conn(
    tcp: TcpStream,
    app: Router,
    limits: ConnLimits,
    metrics: &ConnMetrics,
    stop: CancellationToken,
) {
    let _ = tcp.set_nodelay(true);
    let activity = Arc::new(Activity {
        born: Instant::now(),
        active: AtomicUsize::new(0),
        last_end_ms: AtomicU64::new(u64::MAX),
        changed: tokio::sync::Notify::new(),
    });
    let inner = TowerToHyperService::new(app);
    let act = activity.clone();
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        act.active.fetch_add(1, Ordering::AcqRel);
        act.changed.notify_one();
        let busy = Busy(act.clone());
        let fut = inner.call(req);
        async move {
            let resp: Response<Body> = fut.await?;
            Ok::<_, std::convert::Infallible>(resp.map(|inner| Tracked { inner, _busy: busy }))
        }
    });
    // hyper's own answers to heads it cannot parse get JSON bodies on their way out.
    let io = TokioIo::new(super::parse_errors::JsonParseErrors::new(tcp));
    let conn = http1::Builder::new().keep_alive(true).serve_connection(io, svc);
    tokio::pin!(conn);
    let mut draining = false;
    loop {
        // While busy, look again after a keep-alive period (cheap; the request's own timeouts rule).
        let wake = activity.deadline(&limits).unwrap_or_else(|| Instant::now() + limits.keep_alive_idle);
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "client connection ended with an error");
                }
                return;
            }
            _ = activity.changed.notified() => {}
            _ = stop.cancelled(), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = tokio::time::sleep_until(wake.into()) => {
                if activity.deadline(&limits).is_some_and(|d| d <= Instant::now()) {
                    // Idle (or never finished a head) for too long: dropping the connection closes it.
                    metrics.timed_out.inc();
                    return;
                }
            }
        }
    }
}

/// Answer an over-limit connection with a 503 and close it. The client's request is read and
/// discarded first (up to a second), so closing does not reset the connection before the client
/// has read the answer.
async fn refuse(mut tcp: TcpStream, max: usize) {
    let body = ProxyApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "too_many_connections",
        format!("this proxy is serving its limit of {max} connections (limits.max_connections); retry later"),
    )
    .body()
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        tcp.write_all(head.as_bytes()).await?;
        tcp.write_all(body.as_bytes()).await?;
        tcp.shutdown().await?;
        let mut buf = [0u8; 4096];
        while tcp.read(&mut buf).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}
