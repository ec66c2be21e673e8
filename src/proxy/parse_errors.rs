//! Requests the HTTP layer refuses before the proxy sees them get the same OpenAI-style JSON error
//! as every other refusal.
//!
//! hyper answers a request head it cannot parse itself (400 for a bad method, URI, version or
//! header; 431 for a head past its limits; 414 for a URI too long) with an empty body and closes
//! the connection; no hook reaches the service first. [`JsonParseErrors`] sits between hyper and
//! the socket and recognises that answer on its way out: a response head of one of those statuses
//! with `content-length: 0` and no `content-type`. The proxy's own error answers always carry a
//! JSON body and its content type, so only hyper's match; they are replaced by the same status
//! with a JSON body (`code` `bad_request`, `request_header_too_large` or `uri_too_long`).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::errors::ProxyApiError;

/// hyper's own error answer is a status line and two or three short headers.
const MAX_HEAD: usize = 512;

/// A client connection whose hyper-made parse-error answers are rewritten with JSON bodies.
pub struct JsonParseErrors<T> {
    inner: T,
    /// A rewritten answer being written, and how much of it is out.
    pending: Option<(Vec<u8>, usize)>,
}

impl<T> JsonParseErrors<T> {
    pub fn new(inner: T) -> Self {
        JsonParseErrors { inner, pending: None }
    }
}

/// The JSON answer for hyper's empty one in `head`, if `head` is one. Every write of every
/// response passes here, so anything that is not a 4xx status line is turned away on its first
/// ten bytes, before any scan of the buffer.
pub fn rewrite(head: &[u8]) -> Option<Vec<u8>> {
    if !head.starts_with(b"HTTP/1.1 4") || head.len() > MAX_HEAD {
        return None;
    }
    let text = std::str::from_utf8(head).ok()?;
    if !text.ends_with("\r\n\r\n") {
        return None;
    }
    let lower = text.to_ascii_lowercase();
    if !lower.contains("\r\ncontent-length: 0\r\n") || lower.contains("\r\ncontent-type:") {
        return None;
    }
    let (status, code, message) = match text.get(..13)? {
        "HTTP/1.1 400 " => (
            StatusCode::BAD_REQUEST,
            "bad_request",
            "the request head is not valid HTTP/1.1 (method, target, version or a header)",
        ),
        "HTTP/1.1 431 " => (
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "request_header_too_large",
            "the request head is larger than the proxy accepts (too many or too long headers)",
        ),
        "HTTP/1.1 414 " => (StatusCode::URI_TOO_LONG, "uri_too_long", "the request target is too long"),
        _ => return None,
    };
    let body = ProxyApiError::new(status, code, message).body().to_string();
    let reason = status.canonical_reason().unwrap_or("");
    Some(
        format!(
            "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            status.as_u16(),
            body.len()
        )
        .into_bytes(),
    )
}

impl<T: AsyncWrite + Unpin> JsonParseErrors<T> {
    /// Write the rest of a rewritten answer; `Ready` once all of it is out.
    fn drive(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, sent)) = &mut self.pending {
            if *sent >= bytes.len() {
                self.pending = None;
                break;
            }
            match Pin::new(&mut self.inner).poll_write(cx, &bytes[*sent..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *sent += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonParseErrors<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonParseErrors<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.pending.is_none() {
            match rewrite(buf) {
                Some(answer) => self.pending = Some((answer, 0)),
                None => return Pin::new(&mut self.inner).poll_write(cx, buf),
            }
        }
        // hyper offered its own answer: it counts as written once ours is.
        match self.drive(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(buf.len())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // hyper's error answer is a head alone: one slice. Anything else passes through untouched.
        match bufs {
            [one] if self.pending.is_some() || rewrite(one).is_some() => self.poll_write(cx, one),
            _ => Pin::new(&mut self.inner).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.drive(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut self.inner).poll_flush(cx),
            other => other,
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.drive(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut self.inner).poll_shutdown(cx),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hypers_empty_parse_error_answers_are_rewritten() {
        let hyper_400 =
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: Mon, 07 Dec 2026 16:00:00 GMT\r\n\r\n";
        let out = String::from_utf8(rewrite(hyper_400).expect("rewritten")).expect("utf8");
        assert!(out.starts_with("HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"), "{out}");
        let body = out.split("\r\n\r\n").nth(1).expect("body");
        let v: serde_json::Value = serde_json::from_str(body).expect("json body");
        assert_eq!(v["error"]["code"], "bad_request");
        let hyper_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n";
        assert!(String::from_utf8(rewrite(hyper_431).expect("rewritten"))
            .expect("utf8")
            .contains("request_header_too_large"));
        // The proxy's own answers (a JSON body, a content type) and successes pass untouched.
        let own = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(rewrite(own), None);
        assert_eq!(rewrite(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"), None);
        assert_eq!(rewrite(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n"), None);
        assert_eq!(rewrite(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n"), None, "a head cut short");
        // A body chunk that happens to end a line pair is not looked into.
        assert_eq!(rewrite(b"data: {\"x\": 1}\r\n\r\n"), None);
    }
}
