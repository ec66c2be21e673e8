//! Keep-alive connections to members, driven by the request that uses them.
//!
//! hyper's pooled client runs each connection in a task of its own and hands the response body
//! over a channel that holds one chunk: every SSE event then costs two task switches (often
//! across threads) and a write to the client of its own, because the forwarder never finds more
//! than one event waiting. Here a connection is polled by whoever reads its response (the client
//! connection's own task), so every event already in the read buffer is decoded in one go and
//! leaves in one write, as HAProxy does.
//!
//! Idle connections wait per member (last in, first out: the warmest first; at most
//! [`MAX_IDLE_PER_MEMBER`], none older than [`IDLE_TIMEOUT`]). Nobody polls an idle connection, so
//! a member closing one is noticed at checkout: it is polled once, without a waker, and dropped if
//! it ended or cannot take a request. A request that fails on a reused connection before any
//! response because the connection was closed or reset (a close that raced the checkout) is sent
//! once more on a new connection; a model server's completion has no side effect a second attempt
//! could repeat.
//!
//! Dropping a response body before its end drops the connection, which closes it: the member
//! (vLLM) aborts the request, exactly what a client that hung up wants.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{header, HeaderValue, Request, Response, Uri};
use futures::Stream;
use http_body_util::Full;
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Most idle connections kept per member.
pub const MAX_IDLE_PER_MEMBER: usize = 256;

/// An idle connection older than this is closed rather than reused (members close theirs too:
/// uvicorn after 5 s by default; the checkout notices those).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

type Driver = Pin<Box<Connection<TokioIo<TcpStream>, Full<Bytes>>>>;
type Sender = SendRequest<Full<Bytes>>;

struct Idle {
    sender: Sender,
    driver: Driver,
    since: Instant,
}

/// Why a request got no response.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be made (refused, unreachable, DNS, connect timeout): nothing was sent.
    Connect(String),
    /// The request was sent (or sending failed) and no response head came back.
    Failed(hyper::Error),
}

/// Idle keep-alive connections by member (`host:port`).
pub struct Members {
    idle: Mutex<IdleLists>,
    connect_timeout: Duration,
}

#[derive(Default)]
struct IdleLists {
    by_member: HashMap<String, Vec<Idle>>,
    /// Members leave (pods come and go) and their lists are never checked out again: expired
    /// connections everywhere are closed at most once per [`IDLE_TIMEOUT`].
    last_sweep: Option<Instant>,
}

impl Members {
    pub fn new(connect_timeout: Duration) -> Arc<Members> {
        Arc::new(Members { idle: Mutex::new(IdleLists::default()), connect_timeout })
    }

    /// Send `req` to the member of `uri` (absolute, as built by `member_uri`; `req`'s own URI is
    /// replaced) and wait for the response head. The response body drives the connection as it is
    /// read.
    pub async fn send(
        self: &Arc<Self>,
        uri: &Uri,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<MemberBody>, SendError> {
        let Some(authority) = uri.authority() else {
            return Err(SendError::Connect(format!("{uri} has no host")));
        };
        let key = authority.as_str().to_string();
        // hyper's connection writes the URI as given: origin-form on the wire (uvicorn routes the
        // request target as a path), with a Host header. Built from the parsed parts, not re-parsed.
        *req.uri_mut() = uri.path_and_query().cloned().map_or_else(|| Uri::from_static("/"), Uri::from);
        if let Ok(host) = HeaderValue::from_str(&key) {
            req.headers_mut().insert(header::HOST, host);
        }
        if let Some(idle) = self.checkout(&key) {
            let retry = clone_request(&req);
            match exchange(idle.sender, idle.driver, req).await {
                Ok((resp, sender, driver)) => return Ok(self.body(resp, sender, driver, key)),
                // Closed under us before answering: once more, on a connection of its own.
                Err(e) if closed_under_us(&e) => req = retry,
                Err(e) => return Err(SendError::Failed(e)),
            }
        }
        let (sender, driver) = self.connect(&key).await?;
        let (resp, sender, driver) = exchange(sender, driver, req).await.map_err(SendError::Failed)?;
        Ok(self.body(resp, sender, driver, key))
    }

    fn body(
        self: &Arc<Self>,
        resp: Response<Incoming>,
        sender: Sender,
        driver: Option<Driver>,
        key: String,
    ) -> Response<MemberBody> {
        resp.map(|body| MemberBody { body, driver, sender: Some(sender), pool: Arc::downgrade(self), key })
    }

    async fn connect(&self, key: &str) -> Result<(Sender, Driver), SendError> {
        let tcp = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(key)).await {
            Err(_) => {
                return Err(SendError::Connect(format!("connect timed out after {:?}", self.connect_timeout)))
            }
            Ok(Err(e)) => return Err(SendError::Connect(e.to_string())),
            Ok(Ok(tcp)) => tcp,
        };
        // Tokens are small writes: Nagle would hold each behind the previous one's ACK.
        let _ = tcp.set_nodelay(true);
        let (sender, conn) = http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| SendError::Connect(format!("HTTP handshake: {e}")))?;
        Ok((sender, Box::pin(conn)))
    }

    /// The most recently idle connection to `key` that can still take a request.
    fn checkout(&self, key: &str) -> Option<Idle> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle.by_member.get_mut(key)?;
        let now = Instant::now();
        list.retain(|c| now.duration_since(c.since) < IDLE_TIMEOUT);
        while let Some(mut c) = list.pop() {
            // Polled without a waker: reads what the member sent meanwhile (a close, typically).
            let mut cx = Context::from_waker(Waker::noop());
            if c.driver.as_mut().poll(&mut cx).is_pending() && c.sender.is_ready() {
                return Some(c);
            }
        }
        None
    }

    fn checkin(&self, key: String, sender: Sender, driver: Driver) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if idle.last_sweep.is_none_or(|t| now.duration_since(t) >= IDLE_TIMEOUT) {
            idle.last_sweep = Some(now);
            idle.by_member.retain(|_, list| {
                list.retain(|c| now.duration_since(c.since) < IDLE_TIMEOUT);
                !list.is_empty()
            });
        }
        let list = idle.by_member.entry(key).or_default();
        if list.len() >= MAX_IDLE_PER_MEMBER {
            list.remove(0);
        }
        list.push(Idle { sender, driver, since: now });
    }

    /// Idle connections held now.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).by_member.values().map(Vec::len).sum()
    }
}

/// An error that says a reused connection was already closed by the member (its keep-alive timer
/// raced our checkout): refused as not ready, closed before a response, or reset on write.
fn closed_under_us(e: &hyper::Error) -> bool {
    use std::error::Error as _;
    if e.is_canceled() || e.is_incomplete_message() {
        return true;
    }
    let mut source = e.source();
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            return matches!(io.kind(), ConnectionReset | ConnectionAborted | BrokenPipe);
        }
        source = s.source();
    }
    false
}

fn clone_request(req: &Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    // `Full` holds the whole body as one `Bytes`: cloning it is a reference count.
    let mut r = Request::new(req.body().clone());
    *r.method_mut() = req.method().clone();
    *r.uri_mut() = req.uri().clone();
    *r.headers_mut() = req.headers().clone();
    r
}

/// Send on `sender` while driving `driver`, until the response head arrives. The driver is `None`
/// afterwards when the connection already ended (its body then ends without it).
async fn exchange(
    mut sender: Sender,
    driver: Driver,
    req: Request<Full<Bytes>>,
) -> Result<(Response<Incoming>, Sender, Option<Driver>), hyper::Error> {
    let mut driver = Some(driver);
    let mut response = std::pin::pin!(sender.send_request(req));
    let resp = std::future::poll_fn(|cx| {
        if let Some(d) = driver.as_mut() {
            if d.as_mut().poll(cx).is_ready() {
                // Ended (closed or failed): the request's own future reports why.
                driver = None;
            }
        }
        response.as_mut().poll(cx)
    })
    .await?;
    Ok((resp, sender, driver))
}

/// A member's response body that drives its connection while it is read, and gives the connection
/// back for reuse once the body has ended.
pub struct MemberBody {
    body: Incoming,
    driver: Option<Driver>,
    sender: Option<Sender>,
    pool: std::sync::Weak<Members>,
    key: String,
}

impl MemberBody {
    fn release(&mut self, cx: &mut Context<'_>) {
        let (Some(mut driver), Some(sender)) = (self.driver.take(), self.sender.take()) else { return };
        // One more poll lets the connection finish the message and become idle.
        if driver.as_mut().poll(cx).is_ready() {
            return;
        }
        if let Some(pool) = self.pool.upgrade() {
            pool.checkin(std::mem::take(&mut self.key), sender, driver);
        }
    }
}

impl Stream for MemberBody {
    type Item = Result<Bytes, hyper::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let mut driven = false;
        loop {
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        // The last bytes of a body with a length: give the connection back now.
                        // A server writing a `Content-Length` answer stops polling (and drops the
                        // body) once the length is written, so the end would never be seen here.
                        if this.body.is_end_stream() {
                            this.release(cx);
                        }
                        return Poll::Ready(Some(Ok(data)));
                    }
                    // Trailers: nothing a client of the proxy reads.
                    Err(_) => continue,
                },
                Poll::Ready(Some(Err(e))) => {
                    this.driver = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.release(cx);
                    return Poll::Ready(None);
                }
                Poll::Pending => {}
            }
            // Nothing decoded yet: let the connection read and decode, then look again once.
            match this.driver.as_mut() {
                Some(d) if !driven => {
                    driven = true;
                    if d.as_mut().poll(cx).is_ready() {
                        // Ended: the body's channel closes with it and reports how.
                        this.driver = None;
                    }
                }
                _ => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// What a test member does with the requests of one connection, by their index on it.
    #[derive(Clone, Copy)]
    enum Member {
        /// Answers every request (keep-alive).
        KeepAlive,
        /// Answers the first request, then closes the connection when the second one arrives
        /// (a member's idle close racing the proxy's checkout).
        ClosesOnSecond,
        /// The same, with a reset (RST) instead of an orderly close.
        ResetsOnSecond,
        /// Streams a chunked body forever, one chunk per 10 ms.
        Endless,
    }

    /// A raw HTTP/1.1 member on loopback; returns its address and how many connections it accepted.
    async fn member(kind: Member) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (a, c) = (accepted.clone(), closed.clone());
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = l.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                let c = c.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    for i in 0.. {
                        // One request: a head and a 2-byte body ("{}") per read in these tests.
                        let n = match tcp.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        // What uvicorn routes on: an origin-form target, and the member as Host.
                        let head = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
                        if !head.starts_with("post /v1/chat/completions http/1.1\r\n")
                            || !head.contains("\r\nhost: 127.0.0.1:")
                        {
                            let _ = tcp
                                .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 3\r\n\r\nbad")
                                .await;
                            continue;
                        }
                        match (kind, i) {
                            (Member::ClosesOnSecond, 1) => break,
                            (Member::ResetsOnSecond, 1) => {
                                // Linger 0: close sends RST, what a member under pressure may do.
                                #[allow(deprecated)]
                                let _ = tcp.set_linger(Some(Duration::ZERO));
                                break;
                            }
                            (Member::Endless, _) => {
                                let _ = tcp
                                    .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                                    .await;
                                while tcp.write_all(b"5\r\nhello\r\n").await.is_ok() {
                                    tokio::time::sleep(Duration::from_millis(10)).await;
                                }
                                break;
                            }
                            _ => {
                                let _ =
                                    tcp.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                            }
                        }
                    }
                    c.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        (addr, accepted, closed)
    }

    fn request(addr: &str) -> (Uri, Request<Full<Bytes>>) {
        let uri: Uri = format!("http://{addr}/v1/chat/completions").parse().expect("uri");
        let mut req = Request::new(Full::new(Bytes::from_static(b"{}")));
        *req.method_mut() = axum::http::Method::POST;
        (uri, req)
    }

    async fn body_of(resp: Response<MemberBody>) -> Vec<u8> {
        let mut body = resp.into_body();
        let mut out = Vec::new();
        while let Some(chunk) = body.next().await {
            out.extend_from_slice(&chunk.expect("chunk"));
        }
        out
    }

    #[tokio::test]
    async fn sequential_requests_reuse_one_connection() {
        let (addr, accepted, _) = member(Member::KeepAlive).await;
        let pool = Members::new(Duration::from_secs(1));
        for _ in 0..20 {
            let (uri, req) = request(&addr);
            let resp = pool.send(&uri, req).await.expect("response");
            assert_eq!(body_of(resp).await, b"ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_body_read_to_its_length_gives_the_connection_back_without_waiting_for_its_end() {
        let (addr, accepted, _) = member(Member::KeepAlive).await;
        let pool = Members::new(Duration::from_secs(1));
        for _ in 0..5 {
            let (uri, req) = request(&addr);
            let mut body = pool.send(&uri, req).await.expect("response").into_body();
            // What hyper's server does with a `Content-Length` answer: read the bytes, drop the body.
            assert_eq!(&body.next().await.expect("a chunk").expect("data")[..], b"ok");
            drop(body);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection, reused");
    }

    #[tokio::test]
    async fn a_connection_the_member_closed_is_replaced_without_failing_the_request() {
        for kind in [Member::ClosesOnSecond, Member::ResetsOnSecond] {
            let (addr, accepted, _) = member(kind).await;
            let pool = Members::new(Duration::from_secs(1));
            for _ in 0..5 {
                let (uri, req) = request(&addr);
                let resp = pool.send(&uri, req).await.expect("every request answered");
                assert_eq!(body_of(resp).await, b"ok");
            }
            // Each reuse met a close (or reset) and went out again on a new connection.
            assert_eq!(accepted.load(Ordering::SeqCst), 5);
        }
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_the_connection() {
        let (addr, _, closed) = member(Member::Endless).await;
        let pool = Members::new(Duration::from_secs(1));
        let (uri, req) = request(&addr);
        let mut body = pool.send(&uri, req).await.expect("response").into_body();
        assert_eq!(&body.next().await.expect("a chunk").expect("data")[..], b"hello");
        drop(body);
        // The member sees the close (its writes fail) and nothing was kept for reuse.
        let deadline = Instant::now() + Duration::from_secs(10);
        while closed.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "the member never saw the connection close");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn nothing_listening_is_a_connect_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        drop(l);
        let pool = Members::new(Duration::from_secs(1));
        let (uri, req) = request(&addr);
        assert!(matches!(pool.send(&uri, req).await, Err(SendError::Connect(_))));
    }
}
