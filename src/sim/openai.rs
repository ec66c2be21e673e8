//! OpenAI-compatible wire shapes as vLLM's server writes them: request parsing with vLLM's 400s,
//! response bodies, streaming chunks and the SSE framing (`data: {json}\n\n`, then `data: [DONE]`).
//!
//! Parsing never panics: the body is untrusted bytes. Unknown fields (temperature, top_p, ...) are
//! accepted and ignored, as sampling does not change the simulated timing.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use super::tokenize;

/// An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: None }
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            param: Some("model".into()),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), param: None }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::SERVICE_UNAVAILABLE, message: message.into(), param: None }
    }

    /// The `type` field: vLLM names it after the HTTP status class.
    pub fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Which endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A generation request reduced to what the simulator needs.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    /// Requested model; `None` means the replica's default (vLLM allows omitting it).
    pub model: Option<String>,
    pub prompt_tokens: u32,
    pub max_tokens: Option<u32>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct CompletionBody {
    #[serde(default)]
    model: Option<String>,
    prompt: Value,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    n: Option<i64>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Value,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    n: Option<i64>,
}

fn decode<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad_request("the request body is empty; send a JSON object"));
    }
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() { "malformed JSON" } else { "invalid request" };
        ApiError::bad_request(format!("{what}: {e}"))
    })
}

fn max_tokens(v: Option<i64>) -> Result<Option<u32>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::bad_request(format!("max_tokens must be at least 1, got {n}."))
            .with_param("max_tokens")),
        Some(n) => Ok(Some(u32::try_from(n).unwrap_or(u32::MAX))),
    }
}

fn check_n(n: Option<i64>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::bad_request(format!(
            "n={n} is not supported by the simulator; send n=1 (or omit it) and repeat the request instead"
        ))
        .with_param("n")),
    }
}

/// Parse a `POST /v1/completions` body.
pub fn parse_completion(body: &[u8]) -> Result<GenRequest, ApiError> {
    let b: CompletionBody = decode(body)?;
    check_n(b.n)?;
    let prompt_tokens = match &b.prompt {
        Value::String(s) => tokenize::text_tokens(s),
        Value::Array(items) if !items.is_empty() && items.iter().all(|x| x.is_u64()) => {
            u32::try_from(items.len()).unwrap_or(u32::MAX)
        }
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            tokenize::text_tokens(items[0].as_str().unwrap_or_default())
        }
        Value::Array(_) => return Err(ApiError::bad_request(
            "prompt must be a string, a list with one string, or a list of token ids; batched prompts are \
                 not supported by the simulator",
        )
        .with_param("prompt")),
        _ => {
            return Err(
                ApiError::bad_request("prompt must be a string or a list of token ids").with_param("prompt")
            )
        }
    };
    if prompt_tokens == 0 {
        return Err(ApiError::bad_request("The prompt cannot be empty.").with_param("prompt"));
    }
    let stream = b.stream.unwrap_or(false);
    Ok(GenRequest {
        endpoint: Endpoint::Completions,
        model: b.model,
        prompt_tokens,
        max_tokens: max_tokens(b.max_tokens)?,
        ignore_eos: b.ignore_eos.unwrap_or(false),
        stream,
        include_usage: usage_requested(stream, b.stream_options.as_ref())?,
    })
}

/// Parse a `POST /v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Result<GenRequest, ApiError> {
    let b: ChatBody = decode(body)?;
    check_n(b.n)?;
    if b.messages.is_empty() {
        return Err(
            ApiError::bad_request("messages must contain at least one message").with_param("messages")
        );
    }
    let mut content_tokens: u32 = 0;
    for (i, m) in b.messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool" | "developer") {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].role {:?} is not one of system, user, assistant, tool, developer",
                m.role
            ))
            .with_param("messages"));
        }
        let n = match &m.content {
            Value::String(s) => tokenize::text_tokens(s),
            Value::Null => 0,
            Value::Array(parts) => parts
                .iter()
                .map(|p| p.get("text").and_then(Value::as_str).map(tokenize::text_tokens).unwrap_or(0))
                .fold(0u32, u32::saturating_add),
            _ => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content must be a string or a list of content parts"
                ))
                .with_param("messages"))
            }
        };
        content_tokens = content_tokens.saturating_add(n);
    }
    let stream = b.stream.unwrap_or(false);
    Ok(GenRequest {
        endpoint: Endpoint::Chat,
        model: b.model,
        prompt_tokens: content_tokens.saturating_add(tokenize::chat_template_tokens(b.messages.len())),
        max_tokens: max_tokens(b.max_completion_tokens.or(b.max_tokens))?,
        ignore_eos: b.ignore_eos.unwrap_or(false),
        stream,
        include_usage: usage_requested(stream, b.stream_options.as_ref())?,
    })
}

fn usage_requested(stream: bool, opts: Option<&StreamOptions>) -> Result<bool, ApiError> {
    match opts {
        Some(_) if !stream => {
            Err(ApiError::bad_request("Stream options can only be defined when `stream=True`.")
                .with_param("stream_options"))
        }
        Some(o) => Ok(o.include_usage.unwrap_or(false)),
        None => Ok(false),
    }
}

/// Identity of one response: the same in every chunk.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    pub fn new(endpoint: Endpoint, seq: u64, created: u64, model: String) -> Self {
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        // A 32-hex-digit id like vLLM's uuid4().hex, derived from a per-server sequence number.
        let mixed = (seq as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) ^ (created as u128);
        ResponseMeta { id: format!("{prefix}-{mixed:032x}"), created, model }
    }
}

fn usage(prompt: u32, completion: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "total_tokens": u64::from(prompt) + u64::from(completion),
        "completion_tokens": completion,
        "prompt_tokens_details": null,
    })
}

/// The non-streaming answer.
pub fn full_response(
    endpoint: Endpoint,
    meta: &ResponseMeta,
    text: &str,
    finish_reason: &str,
    prompt: u32,
    completion: u32,
) -> Value {
    match endpoint {
        Endpoint::Completions => json!({
            "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason,
                         "stop_reason": null, "prompt_logprobs": null}],
            "usage": usage(prompt, completion),
        }),
        Endpoint::Chat => json!({
            "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0,
                         "message": {"role": "assistant", "content": text, "tool_calls": []},
                         "logprobs": null, "finish_reason": finish_reason, "stop_reason": null}],
            "usage": usage(prompt, completion),
            "prompt_logprobs": null,
        }),
    }
}

/// One SSE event carrying `v`.
pub fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// The stream's terminator.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// The chat stream's first chunk: the assistant role with empty content.
pub fn chat_role_chunk(meta: &ResponseMeta, include_usage: bool) -> Value {
    let mut v = json!({
        "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                     "finish_reason": null}],
    });
    if include_usage {
        v["usage"] = Value::Null;
    }
    v
}

/// A chunk with one token of text; the last one carries the finish reason.
pub fn token_chunk(
    endpoint: Endpoint,
    meta: &ResponseMeta,
    piece: &str,
    finish_reason: Option<&str>,
    include_usage: bool,
) -> Value {
    let mut v = match endpoint {
        Endpoint::Completions => json!({
            "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "text": piece, "logprobs": null, "finish_reason": finish_reason,
                         "stop_reason": null}],
        }),
        Endpoint::Chat => json!({
            "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "delta": {"content": piece}, "logprobs": null,
                         "finish_reason": finish_reason, "stop_reason": null}],
        }),
    };
    if include_usage {
        v["usage"] = Value::Null;
    }
    v
}

/// The extra final chunk sent when `stream_options.include_usage` is set: no choices, usage.
pub fn usage_chunk(endpoint: Endpoint, meta: &ResponseMeta, prompt: u32, completion: u32) -> Value {
    let object = match endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion.chunk",
    };
    json!({
        "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": [], "usage": usage(prompt, completion),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_prompt_forms() {
        let r = parse_completion(br#"{"model":"m","prompt":"abcdefgh","max_tokens":3}"#).unwrap();
        assert_eq!((r.prompt_tokens, r.max_tokens, r.stream), (2, Some(3), false));
        let r = parse_completion(br#"{"prompt":[1,2,3,4,5]}"#).unwrap();
        assert_eq!((r.prompt_tokens, r.model), (5, None));
        let r = parse_completion(br#"{"prompt":["abcd"]}"#).unwrap();
        assert_eq!(r.prompt_tokens, 1);
        assert!(parse_completion(br#"{"prompt":["a","b"]}"#).is_err());
        assert!(parse_completion(br#"{"prompt":""}"#).is_err());
    }

    #[test]
    fn bad_bodies_are_400_with_a_reason() {
        for (body, needle) in [
            (&b""[..], "empty"),
            (b"{not json", "malformed JSON"),
            (br#"{"model":"m"}"#, "missing field `prompt`"),
            (br#"{"prompt":"x","max_tokens":0}"#, "at least 1, got 0"),
            (br#"{"prompt":"x","max_tokens":-5}"#, "at least 1, got -5"),
            (br#"{"prompt":"x","max_tokens":"many"}"#, "invalid request"),
            (br#"{"prompt":"x","n":3}"#, "n=3"),
            (br#"{"prompt":"x","stream_options":{"include_usage":true}}"#, "stream=True"),
            (b"[1,2]", "invalid request"),
        ] {
            let e = parse_completion(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(e.message.contains(needle), "{:?} -> {}", String::from_utf8_lossy(body), e.message);
            assert_eq!(e.body()["error"]["code"], 400);
            assert_eq!(e.body()["error"]["type"], "BadRequestError");
        }
    }

    #[test]
    fn chat_counts_content_and_template() {
        let r = parse_chat(
            br#"{"model":"m","messages":[{"role":"system","content":"abcd"},
                {"role":"user","content":[{"type":"text","text":"abcdefgh"}]}],
                "max_completion_tokens":7,"stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert_eq!(r.prompt_tokens, 1 + 2 + 15);
        assert_eq!((r.max_tokens, r.stream, r.include_usage), (Some(7), true, true));
        assert!(parse_chat(br#"{"messages":[]}"#).is_err());
        assert!(parse_chat(br#"{"messages":[{"role":"wizard","content":"x"}]}"#).is_err());
        assert!(parse_chat(br#"{"messages":[{"role":"user","content":5}]}"#).is_err());
    }

    #[test]
    fn chunks_have_vllm_shape() {
        let meta = ResponseMeta::new(Endpoint::Chat, 1, 1_700_000_000, "m".into());
        assert!(meta.id.starts_with("chatcmpl-") && meta.id.len() == "chatcmpl-".len() + 32);
        let c = token_chunk(Endpoint::Chat, &meta, " hi", Some("length"), false);
        assert_eq!(c["choices"][0]["delta"]["content"], " hi");
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        assert!(c.get("usage").is_none());
        assert_eq!(sse(&json!({"a":1})), "data: {\"a\":1}\n\n");
        let u = usage_chunk(Endpoint::Completions, &meta, 3, 4);
        assert_eq!(u["usage"]["total_tokens"], 7);
        assert_eq!(u["choices"].as_array().map(Vec::len), Some(0));
    }
}
