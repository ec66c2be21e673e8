//! Keep-alive connections to members, driven by the request that uses them.
//!
//! A connection is read by whoever reads its response (the client connection's own task): every
//! byte already in the read buffer is decoded in one pass ([`super::wire`]) and leaves in one write,
//! as HAProxy does. hyper's client was used here before: its connection task, or its body channel
//! that holds one decoded chunk, cost a hand-off and a buffer reference per SSE event
//! (src/proxy/RESULTS.md has the numbers of both designs).
//!
//! Idle connections wait per member (last in, first out: the warmest first; at most
//! [`MAX_IDLE_PER_MEMBER`], none older than [`IDLE_TIMEOUT`]). Nobody reads an idle connection, so
//! a member closing one is noticed at checkout: it is peeked once, without waiting, and dropped if
//! it ended or holds bytes nobody asked for. A request that fails on a reused connection before any
//! response because the connection was closed or reset (a close that raced the checkout) is sent
//! once more on a new connection; a model server's completion has no side effect a second attempt
//! could repeat.
//!
//! Dropping a response body before its end drops the connection, which closes it: the member
//! (vLLM) aborts the request, exactly what a client that hung up wants.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, Response, Uri};
use bytes::{Buf, BytesMut};
use futures::Stream;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::wire::{self, Framing, Head};

/// Most idle connections kept per member.
pub const MAX_IDLE_PER_MEMBER: usize = 256;

/// An idle connection older than this is closed rather than reused (members close theirs too:
/// uvicorn after 5 s by default; the checkout notices those).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Room made in the read buffer before each read: a few hundred SSE events.
const READ_AHEAD: usize = 32 << 10;

/// One connection to a member and what has been read from it but not yet decoded.
struct Conn {
    tcp: TcpStream,
    buf: BytesMut,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// Why a request got no response.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be made (refused, unreachable, DNS, connect timeout): nothing was sent.
    Connect(String),
    /// The request was sent (or sending failed) and no usable response head came back.
    Failed(String),
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

    /// POST `body` with `headers` (already free of hop-by-hop fields, `host` and `content-length`)
    /// to the member of `uri` (absolute, as built by `member_uri`) and wait for the response head.
    /// The response body reads the connection as it is read.
    pub async fn send(
        self: &Arc<Self>,
        uri: &Uri,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Response<MemberBody>, SendError> {
        let Some(authority) = uri.authority() else {
            return Err(SendError::Connect(format!("{uri} has no host")));
        };
        let key = authority.as_str();
        // Origin-form on the wire (uvicorn routes the request target as a path), the member as Host.
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let head = wire::request_head(path, key, headers, body.len());
        if let Some(conn) = self.checkout(key) {
            match exchange(conn, &head, &body).await {
                Ok((h, conn)) => return Ok(self.body(h, conn, key)),
                // Closed under us before answering: once more, on a connection of its own.
                Err(Failure::Closed(_)) => {}
                Err(Failure::Other(e)) => return Err(SendError::Failed(e)),
            }
        }
        let conn = self.connect(key).await?;
        match exchange(conn, &head, &body).await {
            Ok((h, conn)) => Ok(self.body(h, conn, key)),
            Err(Failure::Closed(e) | Failure::Other(e)) => Err(SendError::Failed(e)),
        }
    }

    fn body(self: &Arc<Self>, head: Head, conn: Conn, key: &str) -> Response<MemberBody> {
        let Head { status, headers, framing, reusable } = head;
        let mut r = Response::new(MemberBody {
            conn: Some(conn),
            framing,
            reusable,
            pool: Arc::downgrade(self),
            key: key.to_string(),
        });
        *r.status_mut() = status;
        *r.headers_mut() = headers;
        r
    }

    async fn connect(&self, key: &str) -> Result<Conn, SendError> {
        let tcp = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(key)).await {
            Err(_) => {
                return Err(SendError::Connect(format!("connect timed out after {:?}", self.connect_timeout)))
            }
            Ok(Err(e)) => return Err(SendError::Connect(e.to_string())),
            Ok(Ok(tcp)) => tcp,
        };
        // Tokens are small writes: Nagle would hold each behind the previous one's ACK.
        let _ = tcp.set_nodelay(true);
        Ok(Conn { tcp, buf: BytesMut::new() })
    }

    /// The most recently idle connection to `key` that can still take a request.
    fn checkout(&self, key: &str) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle.by_member.get_mut(key)?;
        let now = Instant::now();
        list.retain(|c| now.duration_since(c.since) < IDLE_TIMEOUT);
        while let Some(c) = list.pop() {
            // Peeked without a waker: an idle connection has nothing to say; a close (or bytes
            // nobody asked for) means it cannot take a request.
            let mut cx = Context::from_waker(Waker::noop());
            let mut one = [0u8; 1];
            if c.conn.tcp.poll_peek(&mut cx, &mut ReadBuf::new(&mut one)).is_pending() {
                return Some(c.conn);
            }
        }
        None
    }

    fn checkin(&self, key: String, conn: Conn) {
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
        list.push(Idle { conn, since: now });
    }

    /// Idle connections held now.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).by_member.values().map(Vec::len).sum()
    }
}

/// Why an exchange gave no response head.
enum Failure {
    /// The connection was closed or reset before any byte of an answer: on a reused connection,
    /// a close that raced the checkout.
    Closed(String),
    Other(String),
}

fn closed_under_us(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(e.kind(), ConnectionReset | ConnectionAborted | BrokenPipe)
}

/// Write the request and read until its response head has arrived.
async fn exchange(mut conn: Conn, head: &[u8], body: &[u8]) -> Result<(Head, Conn), Failure> {
    let mut out = Buf::chain(head, body);
    if let Err(e) = conn.tcp.write_all_buf(&mut out).await {
        let why = format!("sending the request: {e}");
        return Err(if closed_under_us(&e) { Failure::Closed(why) } else { Failure::Other(why) });
    }
    loop {
        match wire::parse_head(&mut conn.buf) {
            Ok(Some(h)) => return Ok((h, conn)),
            Ok(None) => {}
            Err(e) => return Err(Failure::Other(e.to_string())),
        }
        conn.buf.reserve(READ_AHEAD);
        let nothing_yet = conn.buf.is_empty();
        match conn.tcp.read_buf(&mut conn.buf).await {
            Ok(0) if nothing_yet => return Err(Failure::Closed("closed before answering".into())),
            Ok(0) => return Err(Failure::Other("closed in the middle of the response head".into())),
            Ok(_) => {}
            Err(e) if nothing_yet && closed_under_us(&e) => {
                return Err(Failure::Closed(format!("reading the response: {e}")))
            }
            Err(e) => return Err(Failure::Other(format!("reading the response: {e}"))),
        }
    }
}

/// A member's response body that reads its connection while it is read, and gives the connection
/// back for reuse once the body has ended.
pub struct MemberBody {
    /// `None` once the body has ended or failed.
    conn: Option<Conn>,
    framing: Framing,
    reusable: bool,
    pool: std::sync::Weak<Members>,
    key: String,
}

impl MemberBody {
    fn release(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        // Bytes after the body's end would be an answer to nothing: such a connection is closed.
        if self.reusable && conn.buf.is_empty() {
            if let Some(pool) = self.pool.upgrade() {
                pool.checkin(std::mem::take(&mut self.key), conn);
            }
        }
    }
}

impl Stream for MemberBody {
    type Item = Result<Bytes, io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            let Some(conn) = this.conn.as_mut() else { return Poll::Ready(None) };
            let decoded = match this.framing.decode(&mut conn.buf) {
                Ok(d) => d,
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(io::Error::new(io::ErrorKind::InvalidData, e))));
                }
            };
            if decoded.ended {
                // Given back now, not at the next poll: a server writing a `Content-Length` answer
                // stops polling (and drops the body) once the length is written.
                this.release();
                return Poll::Ready((!decoded.data.is_empty()).then_some(Ok(decoded.data)));
            }
            if !decoded.data.is_empty() {
                return Poll::Ready(Some(Ok(decoded.data)));
            }
            conn.buf.reserve(READ_AHEAD);
            match tokio_util::io::poll_read_buf(Pin::new(&mut conn.tcp), cx, &mut conn.buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) => {
                    this.conn = None;
                    if this.framing == Framing::UntilClose {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the member closed the connection before the body's end",
                    ))));
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
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
        /// Answers every request chunked, in pieces of a few bytes (keep-alive).
        Chunked,
        /// Answers with two bytes more than its `Content-Length` says.
        TooLong,
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
                            (Member::Chunked, _) => {
                                let answer: &[&[u8]] = &[
                                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                                    b"2\r\nok\r",
                                    b"\n1;x=y\r\n!\r\n0",
                                    b"\r\n\r\n",
                                ];
                                for piece in answer {
                                    let _ = tcp.write_all(piece).await;
                                    let _ = tcp.flush().await;
                                    tokio::time::sleep(Duration::from_millis(2)).await;
                                }
                            }
                            (Member::TooLong, _) => {
                                let _ =
                                    tcp.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokXX").await;
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

    fn request(addr: &str) -> (Uri, HeaderMap, Bytes) {
        let uri: Uri = format!("http://{addr}/v1/chat/completions").parse().expect("uri");
        (uri, HeaderMap::new(), Bytes::from_static(b"{}"))
    }

    /// Send `n` requests one after another to a new member of `kind` and check each answer's body;
    /// the pool and how many connections the member accepted.
    async fn answers(kind: Member, n: usize, expected: &[u8]) -> (Arc<Members>, usize) {
        let (addr, accepted, _) = member(kind).await;
        let pool = Members::new(Duration::from_secs(1));
        for i in 0..n {
            let (uri, h, req) = request(&addr);
            let resp = pool.send(&uri, &h, req).await.unwrap_or_else(|e| panic!("request {i}: {e:?}"));
            assert_eq!(body_of(resp).await, expected, "request {i}");
        }
        (pool, accepted.load(Ordering::SeqCst))
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
        let (pool, accepted) = answers(Member::KeepAlive, 20, b"ok").await;
        assert_eq!(accepted, 1);
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_body_read_to_its_length_gives_the_connection_back_without_waiting_for_its_end() {
        let (addr, accepted, _) = member(Member::KeepAlive).await;
        let pool = Members::new(Duration::from_secs(1));
        for _ in 0..5 {
            let (uri, h, req) = request(&addr);
            let mut body = pool.send(&uri, &h, req).await.expect("response").into_body();
            // What hyper's server does with a `Content-Length` answer: read the bytes, drop the body.
            assert_eq!(&body.next().await.expect("a chunk").expect("data")[..], b"ok");
            drop(body);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection, reused");
    }

    #[tokio::test]
    async fn a_connection_the_member_closed_is_replaced_without_failing_the_request() {
        for kind in [Member::ClosesOnSecond, Member::ResetsOnSecond] {
            // Every request answered; each reuse met a close (or reset) and went out again on a
            // new connection.
            let (_, accepted) = answers(kind, 5, b"ok").await;
            assert_eq!(accepted, 5);
        }
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_the_connection() {
        let (addr, _, closed) = member(Member::Endless).await;
        let pool = Members::new(Duration::from_secs(1));
        let (uri, h, req) = request(&addr);
        let mut body = pool.send(&uri, &h, req).await.expect("response").into_body();
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
    async fn a_chunked_answer_in_pieces_is_decoded_and_its_connection_reused() {
        let (_, accepted) = answers(Member::Chunked, 5, b"ok!").await;
        assert_eq!(accepted, 1, "the end of the chunks frees the connection");
    }

    #[tokio::test]
    async fn bytes_past_the_end_of_an_answer_keep_its_connection_from_reuse() {
        // The body is what the length says; the rest would be taken for the next answer.
        let (pool, accepted) = answers(Member::TooLong, 3, b"ok").await;
        assert_eq!(accepted, 3);
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn nothing_listening_is_a_connect_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        drop(l);
        let pool = Members::new(Duration::from_secs(1));
        let (uri, h, req) = request(&addr);
        assert!(matches!(pool.send(&uri, &h, req).await, Err(SendError::Connect(_))));
    }
}
