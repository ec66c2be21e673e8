//! HTTP/1.1 as a member speaks it: the request head we write, the response head we read, and the
//! body's framing (RFC 9112 §6-7), decoded straight out of the connection's read buffer.
//!
//! Pure: bytes in, bytes out, no I/O, so every split of the input can be tested. The connection
//! side is [`super::members`]. Why not hyper's client: it decodes one chunk at a time and hands each
//! over a channel to the body, so a stream of 200 small SSE events costs 200 decodes, channel
//! hand-offs and buffer reference counts in the proxy. Here everything already read is decoded in
//! one pass into one piece, which is what the client gets in one write (see src/proxy/RESULTS.md).
//!
//! Limits, because the member's bytes are not ours: a head of at most [`MAX_HEAD`] bytes and
//! [`MAX_HEADERS`] fields, chunk-size lines and trailers bounded, sizes checked for overflow.

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use bytes::{Buf, BytesMut};

/// Largest response head read from a member.
pub const MAX_HEAD: usize = 64 << 10;
/// Most header fields in a response head.
pub const MAX_HEADERS: usize = 128;
/// Longest chunk-size line (size, extensions): real ones are a few bytes.
const MAX_SIZE_LINE: usize = 4 << 10;
/// Most trailer bytes read (and dropped: nothing a client of the proxy reads).
const MAX_TRAILERS: usize = 16 << 10;

/// The request head for a POST of `body_len` bytes to `path` on `host`. `headers` must already be
/// free of hop-by-hop fields, `host` and `content-length` (the caller's job: it knows which of
/// the client's headers go on).
pub fn request_head(path: &str, host: &str, headers: &HeaderMap, body_len: usize) -> Vec<u8> {
    let mut h = Vec::with_capacity(128 + headers.len() * 48);
    h.extend_from_slice(b"POST ");
    h.extend_from_slice(path.as_bytes());
    h.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    h.extend_from_slice(host.as_bytes());
    h.extend_from_slice(b"\r\n");
    for (k, v) in headers {
        h.extend_from_slice(k.as_str().as_bytes());
        h.extend_from_slice(b": ");
        h.extend_from_slice(v.as_bytes());
        h.extend_from_slice(b"\r\n");
    }
    h.extend_from_slice(b"content-length: ");
    h.extend_from_slice(body_len.to_string().as_bytes());
    h.extend_from_slice(b"\r\n\r\n");
    h
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub framing: Framing,
    /// The connection may carry another request once this body has ended.
    pub reusable: bool,
}

/// How the body's end is known.
#[derive(Debug, Clone, PartialEq)]
pub enum Framing {
    /// `Content-Length`: this many bytes are left.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked(Chunked),
    /// Neither: the body ends when the member closes the connection.
    UntilClose,
}

/// Why a member's bytes were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WireError {
    #[error("the response head is longer than {MAX_HEAD} bytes")]
    HeadTooLong,
    #[error("malformed response head: {0}")]
    Head(String),
    #[error("malformed chunked body: {0}")]
    Chunk(&'static str),
}

/// Parse a response head from the start of `buf`, consuming it. `Ok(None)`: not all of it has
/// arrived. Interim (1xx) responses are consumed and skipped.
pub fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, WireError> {
    loop {
        let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut fields);
        let len = match resp.parse(buf) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => return Err(WireError::HeadTooLong),
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(WireError::Head(e.to_string())),
        };
        if len > MAX_HEAD {
            return Err(WireError::HeadTooLong);
        }
        let code = resp.code.unwrap_or(0);
        let status = StatusCode::from_u16(code).map_err(|_| WireError::Head(format!("status {code}")))?;
        if status.is_informational() {
            if status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(WireError::Head("101 Switching Protocols to a POST".into()));
            }
            buf.advance(len);
            continue;
        }
        let mut headers = HeaderMap::with_capacity(resp.headers.len());
        for f in resp.headers.iter() {
            let name = HeaderName::from_bytes(f.name.as_bytes())
                .map_err(|_| WireError::Head("a header name that is not a token".into()))?;
            let value = HeaderValue::from_bytes(f.value)
                .map_err(|_| WireError::Head(format!("header {name}: a value with control bytes")))?;
            headers.append(name, value);
        }
        let http11 = resp.version == Some(1);
        buf.advance(len);
        let (framing, framed_by_both) = framing_of(status, &headers)?;
        let closes = headers
            .get_all(axum::http::header::CONNECTION)
            .iter()
            .any(|v| v.to_str().is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close"))));
        // RFC 9112 §6.3: a message with both a length and chunked coding may be a smuggling attempt;
        // it is read as chunked and the connection is not used again.
        let reusable = http11 && !closes && !framed_by_both && framing != Framing::UntilClose;
        return Ok(Some(Head { status, headers, framing, reusable }));
    }
}

fn framing_of(status: StatusCode, headers: &HeaderMap) -> Result<(Framing, bool), WireError> {
    use axum::http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
    if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok((Framing::Length(0), false));
    }
    let has_length = headers.contains_key(CONTENT_LENGTH);
    if headers.contains_key(TRANSFER_ENCODING) {
        // Only a final `chunked` frames the body; any other coding runs to the close.
        let last = headers
            .get_all(TRANSFER_ENCODING)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .rfind(|t| !t.is_empty());
        let chunked = last.is_some_and(|t| t.eq_ignore_ascii_case("chunked"));
        let framing = if chunked { Framing::Chunked(Chunked::default()) } else { Framing::UntilClose };
        return Ok((framing, has_length));
    }
    let mut length: Option<u64> = None;
    for v in headers.get_all(CONTENT_LENGTH) {
        // A list of equal values is allowed (RFC 9110 §8.6); anything else is refused.
        for part in v.to_str().map_err(|_| WireError::Head("content-length is not ASCII".into()))?.split(',')
        {
            let part = part.trim();
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(WireError::Head(format!("content-length {part:?}")));
            }
            let n: u64 = part.parse().map_err(|_| WireError::Head("content-length too large".into()))?;
            if length.is_some_and(|l| l != n) {
                return Err(WireError::Head("two different content-lengths".into()));
            }
            length = Some(n);
        }
    }
    Ok((length.map_or(Framing::UntilClose, Framing::Length), false))
}

/// Where a chunked decoder stands between two reads.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Chunked {
    /// Waiting for a chunk-size line.
    #[default]
    Size,
    /// Inside a chunk's data: this many bytes are left.
    Data(u64),
    /// After a chunk's data: its CRLF.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one; bytes of trailers seen so far.
    Trailers(usize),
    /// The body has ended.
    Done,
}

/// What one pass over the read buffer gave.
#[derive(Debug, Default, PartialEq)]
pub struct Decoded {
    /// Body bytes, everything that was complete in the buffer, in one piece (empty: none yet).
    pub data: Bytes,
    /// The body ended in this pass.
    pub ended: bool,
}

impl Framing {
    /// Take every body byte `buf` holds (consuming its framing); the rest waits for more input.
    /// Bytes after the body's end stay in `buf`.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, WireError> {
        match self {
            Framing::Length(left) => {
                let n = (*left).min(buf.len() as u64) as usize;
                *left -= n as u64;
                Ok(Decoded { data: take(buf, n), ended: *left == 0 })
            }
            Framing::UntilClose => Ok(Decoded { data: take(buf, buf.len()), ended: false }),
            Framing::Chunked(state) => state.decode(buf),
        }
    }
}

/// The first `n` bytes of `buf` as their own allocation, so the read buffer stays unshared and is
/// reused for the next read instead of reallocated.
fn take(buf: &mut BytesMut, n: usize) -> Bytes {
    if n == 0 {
        return Bytes::new();
    }
    let out = Bytes::copy_from_slice(&buf[..n]);
    buf.advance(n);
    out
}

impl Chunked {
    fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, WireError> {
        let mut out: Vec<u8> = Vec::new();
        loop {
            match *self {
                Chunked::Done => return Ok(Decoded { data: out.into(), ended: true }),
                Chunked::Size => {
                    let Some(end) = line_end(buf) else {
                        if buf.len() > MAX_SIZE_LINE {
                            return Err(WireError::Chunk("chunk-size line too long"));
                        }
                        break;
                    };
                    let size = chunk_size(&buf[..end])?;
                    buf.advance(end + 2);
                    *self = if size == 0 { Chunked::Trailers(0) } else { Chunked::Data(size) };
                    if out.capacity() == 0 {
                        // Most passes hold this chunk and maybe a few more of its size.
                        out.reserve((size as usize).min(buf.len()).max(64));
                    }
                }
                Chunked::Data(left) => {
                    if buf.is_empty() {
                        break;
                    }
                    let n = left.min(buf.len() as u64) as usize;
                    out.extend_from_slice(&buf[..n]);
                    buf.advance(n);
                    *self = if left == n as u64 { Chunked::DataEnd } else { Chunked::Data(left - n as u64) };
                }
                Chunked::DataEnd => {
                    if buf.len() < 2 {
                        break;
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(WireError::Chunk("chunk data not followed by CRLF"));
                    }
                    buf.advance(2);
                    *self = Chunked::Size;
                }
                Chunked::Trailers(seen) => {
                    let Some(end) = line_end(buf) else {
                        if seen + buf.len() > MAX_TRAILERS {
                            return Err(WireError::Chunk("trailers too long"));
                        }
                        break;
                    };
                    buf.advance(end + 2);
                    *self = if end == 0 { Chunked::Done } else { Chunked::Trailers(seen + end + 2) };
                    if seen + end + 2 > MAX_TRAILERS {
                        return Err(WireError::Chunk("trailers too long"));
                    }
                }
            }
        }
        Ok(Decoded { data: out.into(), ended: false })
    }
}

/// Where the first CRLF of `buf` starts.
fn line_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n")
}

/// The size of a chunk-size line (hex digits, then optional extensions after `;`).
fn chunk_size(line: &[u8]) -> Result<u64, WireError> {
    let digits_end = line.iter().position(|b| !b.is_ascii_hexdigit()).unwrap_or(line.len());
    if digits_end == 0 {
        return Err(WireError::Chunk("chunk size is not hex"));
    }
    let rest = &line[digits_end..];
    let rest_ok = rest.is_empty() || {
        let t =
            rest.iter().position(|&b| b != b' ' && b != b'\t').map_or(&rest[rest.len()..], |i| &rest[i..]);
        t.is_empty() || t[0] == b';'
    };
    if !rest_ok {
        return Err(WireError::Chunk("junk after the chunk size"));
    }
    let mut size: u64 = 0;
    for &b in &line[..digits_end] {
        let d = (b as char).to_digit(16).unwrap_or(0) as u64;
        size = size
            .checked_mul(16)
            .and_then(|s| s.checked_add(d))
            .ok_or(WireError::Chunk("chunk size overflows"))?;
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Result<Option<Head>, WireError> {
        parse_head(&mut BytesMut::from(text.as_bytes()))
    }

    /// Feed `input` to a decoder `step` bytes at a time; the body and whether it ended.
    fn decode_in_steps(
        mut framing: Framing,
        input: &[u8],
        step: usize,
    ) -> Result<(Vec<u8>, bool, Vec<u8>), WireError> {
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        for piece in input.chunks(step.max(1)) {
            buf.extend_from_slice(piece);
            let d = framing.decode(&mut buf)?;
            body.extend_from_slice(&d.data);
            if d.ended {
                return Ok((body, true, buf.to_vec()));
            }
        }
        Ok((body, false, buf.to_vec()))
    }

    #[test]
    fn the_request_head_carries_host_headers_and_length() {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/json"));
        let text = String::from_utf8(request_head("/v1/chat/completions", "10.0.0.1:8000", &h, 17)).unwrap();
        assert_eq!(
            text,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.1:8000\r\ncontent-type: application/json\r\ncontent-length: 17\r\n\r\n"
        );
    }

    #[test]
    fn heads_give_status_headers_framing_and_reuse() {
        let h =
            head("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                .unwrap()
                .unwrap();
        assert_eq!(h.status, StatusCode::OK);
        assert_eq!(h.headers["content-type"], "text/event-stream");
        assert_eq!(h.framing, Framing::Chunked(Chunked::Size));
        assert!(h.reusable);
        let h = head("HTTP/1.1 404 Not Found\r\ncontent-length: 3\r\nconnection: close\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            (h.status, h.framing.clone(), h.reusable),
            (StatusCode::NOT_FOUND, Framing::Length(3), false)
        );
        // No length, no chunks: the close ends it, so nothing can follow on this connection.
        let h = head("HTTP/1.1 200 OK\r\n\r\n").unwrap().unwrap();
        assert_eq!((h.framing.clone(), h.reusable), (Framing::UntilClose, false));
        // HTTP/1.0 connections are not kept.
        assert!(!head("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n").unwrap().unwrap().reusable);
        assert_eq!(head("HTTP/1.1 204 No Content\r\n\r\n").unwrap().unwrap().framing, Framing::Length(0));
    }

    #[test]
    fn a_partial_head_waits_and_an_interim_one_is_skipped() {
        assert!(head("HTTP/1.1 200 OK\r\ncontent-len").unwrap().is_none());
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"[..],
        );
        let h = parse_head(&mut buf).unwrap().unwrap();
        assert_eq!(h.status, StatusCode::OK);
        assert_eq!(&buf[..], b"ok", "the body stays in the buffer");
    }

    #[test]
    fn bad_heads_are_refused_with_a_reason() {
        assert!(matches!(head("HTTP/1.1 2x0 OK\r\n\r\n"), Err(WireError::Head(_))));
        assert!(matches!(
            head("HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n"),
            Err(WireError::Head(_))
        ));
        assert!(matches!(head("HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n"), Err(WireError::Head(_))));
        assert!(matches!(head("HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n"), Err(WireError::Head(_))));
        assert!(matches!(head("HTTP/1.1 101 Switching Protocols\r\n\r\n"), Err(WireError::Head(_))));
        // Equal values in a list are one length.
        assert_eq!(
            head("HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\n").unwrap().unwrap().framing,
            Framing::Length(2)
        );
        let long = format!("HTTP/1.1 200 OK\r\nx-pad: {}\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(head(&long).unwrap_err(), WireError::HeadTooLong);
        let many: String = (0..MAX_HEADERS + 1).map(|i| format!("x-{i}: v\r\n")).collect();
        assert!(head(&format!("HTTP/1.1 200 OK\r\n{many}\r\n")).is_err());
    }

    #[test]
    fn length_and_chunked_together_read_as_chunked_on_a_connection_not_reused() {
        let h = head("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(h.framing, Framing::Chunked(Chunked::Size));
        assert!(!h.reusable);
        // A final coding other than chunked runs to the close.
        let h = head("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n").unwrap().unwrap();
        assert_eq!(h.framing, Framing::UntilClose);
    }

    #[test]
    fn a_chunked_body_decodes_the_same_at_every_split() {
        let input = b"5\r\nhello\r\n1;ext=1\r\n \r\nA \r\n0123456789\r\n0\r\nx-trailer: t\r\n\r\nNEXT";
        for step in 1..=input.len() {
            let (body, ended, rest) = decode_in_steps(Framing::Chunked(Chunked::Size), input, step).unwrap();
            assert_eq!(body, b"hello 0123456789", "step {step}");
            assert!(ended, "step {step}");
            // Bytes after the body (a pipelined answer would start here) are not eaten.
            assert_eq!(rest, b"NEXT".get(..rest.len()).unwrap_or_default(), "step {step}");
        }
    }

    #[test]
    fn everything_complete_in_the_buffer_comes_out_as_one_piece() {
        let mut f = Framing::Chunked(Chunked::Size);
        let mut buf = BytesMut::from(&b"3\r\nabc\r\n3\r\ndef\r\n2\r\ngh"[..]);
        let d = f.decode(&mut buf).unwrap();
        assert_eq!((&d.data[..], d.ended), (&b"abcdefgh"[..], false));
        assert!(buf.is_empty());
        assert_eq!(f, Framing::Chunked(Chunked::DataEnd));
    }

    #[test]
    fn broken_chunks_are_refused() {
        let bad: [&[u8]; 5] = [b"zz\r\n", b"5\r\nhelloXX", b"5 x\r\n", b"fffffffffffffffff\r\n", b"-1\r\n"];
        for input in bad {
            let r = decode_in_steps(Framing::Chunked(Chunked::Size), input, input.len());
            assert!(matches!(r, Err(WireError::Chunk(_))), "{:?}: {r:?}", String::from_utf8_lossy(input));
        }
        let endless_size = vec![b'1'; MAX_SIZE_LINE + 1];
        assert!(decode_in_steps(Framing::Chunked(Chunked::Size), &endless_size, 512).is_err());
        let mut endless_trailers = b"0\r\n".to_vec();
        endless_trailers.extend(std::iter::repeat_n(b"x: y\r\n".as_slice(), MAX_TRAILERS / 6 + 2).flatten());
        assert!(decode_in_steps(Framing::Chunked(Chunked::Size), &endless_trailers, 100).is_err());
    }

    #[test]
    fn a_length_body_ends_at_its_length_and_leaves_the_rest() {
        for step in 1..=9 {
            let (body, ended, rest) = decode_in_steps(Framing::Length(5), b"helloHTTP", step).unwrap();
            assert_eq!((body.as_slice(), ended), (&b"hello"[..], true), "step {step}");
            assert!(b"HTTP".starts_with(&rest));
        }
        let (body, ended, _) = decode_in_steps(Framing::UntilClose, b"all of it", 4).unwrap();
        assert_eq!((body.as_slice(), ended), (&b"all of it"[..], false));
    }
}
