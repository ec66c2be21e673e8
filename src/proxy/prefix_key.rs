//! The prefix key of a request, for `algorithm: prefix-affinity` (and for an LB behind the proxy).
//!
//! A client that knows what its requests share sends it: a session id or a prefix id in
//! [`PREFIX_KEY_HEADER`]. Otherwise, where the config asks for it (`prefix_key_from_body`), the key
//! is the model name and the start of the prompt (the first [`KEY_PROMPT_CHARS`] characters of the
//! first message, or of the prompt): requests with the same system prompt or document share it,
//! unrelated ones almost never do. It is opt-in because a key on a request that shares nothing
//! costs: it is hashed to a server regardless of that server's queue (below the bound). The header's bytes are
//! hashed, whatever they are, and never logged or echoed.

use axum::http::{HeaderMap, HeaderValue};
use serde_json::Value;

/// The header a client may set; the proxy sets it for an LB behind it (`x-llm-prefix-key`).
pub const PREFIX_KEY_HEADER: &str = "x-llm-prefix-key";

/// How much of the prompt's start makes the key when the client sends none.
pub const KEY_PROMPT_CHARS: usize = 256;

/// The request's key: the header's, else (when `from_body`) one from the body, else `None` (the
/// weighted pick).
pub fn prefix_key(headers: &HeaderMap, body: &Value, from_body: bool) -> Option<u64> {
    if let Some(h) = headers.get(PREFIX_KEY_HEADER).filter(|h| !h.is_empty()) {
        return Some(fnv1a(h.as_bytes()));
    }
    if !from_body {
        return None;
    }
    let model = body.get("model").and_then(Value::as_str).unwrap_or("");
    let start = prompt_start(body)?;
    let mut bytes = Vec::with_capacity(model.len() + 1 + start.len());
    bytes.extend_from_slice(model.as_bytes());
    bytes.push(0);
    bytes.extend(start.chars().take(KEY_PROMPT_CHARS).collect::<String>().bytes());
    Some(fnv1a(&bytes))
}

/// The key as the proxy forwards it: 16 lowercase hex digits.
pub fn header_value(key: u64) -> HeaderValue {
    HeaderValue::from_str(&format!("{key:016x}")).expect("hex digits are a valid header value")
}

/// The text a request starts with: the first message's content, or the prompt.
fn prompt_start(body: &Value) -> Option<&str> {
    let first = body.get("messages").and_then(|m| m.get(0)).and_then(|m| m.get("content"));
    let text = match first {
        Some(Value::String(s)) => Some(s.as_str()),
        Some(Value::Array(parts)) => parts.iter().find_map(|p| p.get("text").and_then(Value::as_str)),
        _ => match body.get("prompt") {
            Some(Value::String(s)) => Some(s.as_str()),
            Some(Value::Array(items)) => items.first().and_then(Value::as_str),
            _ => None,
        },
    };
    text.filter(|t| !t.is_empty())
}

/// FNV-1a, 64 bits: stable across processes and releases (the ring must agree with itself).
fn fnv1a(bytes: &[u8]) -> u64 {
    llm_lc_common::fnv1a64(bytes)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn key(headers: &[(&'static str, &[u8])], body: Value) -> Option<u64> {
        let mut h = HeaderMap::new();
        for (name, v) in headers {
            h.insert(*name, axum::http::HeaderValue::from_bytes(v).expect("header bytes"));
        }
        prefix_key(&h, &body, true)
    }

    #[test]
    fn the_header_wins_and_odd_bytes_are_just_hashed() {
        let body = json!({"model": "m", "prompt": "hello"});
        let a = key(&[(PREFIX_KEY_HEADER, b"session-1")], body.clone());
        assert_eq!(a, key(&[(PREFIX_KEY_HEADER, b"session-1")], json!({})));
        assert_ne!(a, key(&[(PREFIX_KEY_HEADER, b"session-2")], body.clone()));
        assert!(key(&[(PREFIX_KEY_HEADER, b"\xff\xfe \"x\\")], body).is_some());
    }

    #[test]
    fn without_a_header_the_model_and_the_prompts_start_make_the_key() {
        let system = "You are a helpful assistant for ACME. ".repeat(20);
        let chat = |model: &str, question: &str| {
            json!({"model": model, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": question}]})
        };
        assert_eq!(key(&[], chat("m", "a?")), key(&[], chat("m", "b?")), "same system prompt");
        assert_ne!(key(&[], chat("m", "a?")), key(&[], chat("other", "a?")), "other model");
        let prompt = |p: &str| json!({"model": "m", "prompt": p});
        assert_ne!(key(&[], prompt("first")), key(&[], prompt("second")));
        assert_eq!(key(&[], json!({"model": "m"})), None, "no prompt: no key");
        assert_eq!(key(&[], json!({"model": "m", "prompt": ""})), None);
        let mut h = HeaderMap::new();
        assert_eq!(prefix_key(&h, &chat("m", "a?"), false), None, "the body key is opt-in");
        h.insert(PREFIX_KEY_HEADER, axum::http::HeaderValue::from_static("s-1"));
        assert!(prefix_key(&h, &chat("m", "a?"), false).is_some(), "a header key always counts");
        h.insert(PREFIX_KEY_HEADER, axum::http::HeaderValue::from_static(""));
        assert_eq!(prefix_key(&h, &json!({}), false), None, "an empty header is no key");
    }
}
