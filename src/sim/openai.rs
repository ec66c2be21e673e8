//! OpenAI-compatible wire shapes as vLLM's server writes them: request parsing with vLLM's 400s,
//! response bodies, streaming chunks and the SSE framing (`data: {json}\n\n`, then `data: [DONE]`).
//!
//! Parsing never panics: the body is untrusted bytes. Unknown fields (temperature, top_p, ...) are
//! accepted and ignored, as sampling does not change the simulated timing.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{prefix, tokenize};

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

    /// Any status with a message (for errors the HTTP layer finds: 404, 405, 413).
    pub fn status(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None }
    }

    /// The `type` field: vLLM names it after the HTTP status class.
    pub fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowedError",
            StatusCode::PAYLOAD_TOO_LARGE => "RequestEntityTooLargeError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    /// The JSON body, fields in vLLM's order.
    pub fn body(&self) -> String {
        #[derive(Serialize)]
        struct Info<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'static str,
            param: Option<&'a str>,
            code: u16,
        }
        #[derive(Serialize)]
        struct Body<'a> {
            error: Info<'a>,
        }
        to_json(&Body {
            error: Info {
                message: &self.message,
                kind: self.kind(),
                param: self.param.as_deref(),
                code: self.status.as_u16(),
            },
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, [(header::CONTENT_TYPE, "application/json")], self.body()).into_response()
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
    /// Hash chain of the prompt's full blocks, for the prefix cache ([`crate::prefix`]).
    pub blocks: Vec<u64>,
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
    let (prompt_tokens, blocks) = match &b.prompt {
        Value::String(s) => (tokenize::text_tokens(s), prefix::text_chain(s)),
        Value::Array(items) if !items.is_empty() && items.iter().all(|x| x.is_u64()) => {
            let ids: Vec<u64> = items.iter().filter_map(Value::as_u64).collect();
            (u32::try_from(items.len()).unwrap_or(u32::MAX), prefix::token_chain(&ids))
        }
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            let text = items[0].as_str().unwrap_or_default();
            (tokenize::text_tokens(text), prefix::text_chain(text))
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
        blocks,
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
    // The conversation as the chat template lays it out, for the prefix cache's hash chain.
    let mut rendered = String::new();
    for (i, m) in b.messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool" | "developer") {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].role {:?} is not one of system, user, assistant, tool, developer",
                m.role
            ))
            .with_param("messages"));
        }
        rendered.push_str("<|start_header_id|>");
        rendered.push_str(&m.role);
        rendered.push_str("<|end_header_id|>\n\n");
        let n = match &m.content {
            Value::String(s) => {
                rendered.push_str(s);
                tokenize::text_tokens(s)
            }
            Value::Null => 0,
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .inspect(|t| rendered.push_str(t))
                .map(tokenize::text_tokens)
                .fold(0u32, u32::saturating_add),
            _ => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content must be a string or a list of content parts"
                ))
                .with_param("messages"))
            }
        };
        content_tokens = content_tokens.saturating_add(n);
        rendered.push_str("<|eot_id|>");
    }
    let stream = b.stream.unwrap_or(false);
    Ok(GenRequest {
        endpoint: Endpoint::Chat,
        model: b.model,
        prompt_tokens: content_tokens.saturating_add(tokenize::chat_template_tokens(b.messages.len())),
        blocks: prefix::text_chain(&rendered),
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

use llm_lc_common::splitmix64;

impl ResponseMeta {
    /// `seq` is unique per server and `salt` tells servers apart; the id has vLLM's shape
    /// (`cmpl-`/`chatcmpl-` and 32 hex digits, like `uuid4().hex`).
    pub fn new(endpoint: Endpoint, seq: u64, salt: u64, created: u64, model: String) -> Self {
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        let hi = splitmix64(seq ^ salt.rotate_left(32) ^ created);
        let lo = splitmix64(hi ^ seq);
        ResponseMeta { id: format!("{prefix}-{hi:016x}{lo:016x}"), created, model }
    }
}

// Typed bodies: serde writes fields in declaration order, which is the order of vLLM's pydantic
// models (`vllm/entrypoints/openai/protocol.py`). `Option<Option<T>>` fields are left out when
// `None` and written as `null` when `Some(None)`, to follow vLLM's exclude_unset/exclude_none
// choices per message kind.

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u32,
    total_tokens: u64,
    completion_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_tokens_details: Option<Option<()>>,
}

impl Usage {
    fn new(prompt: u32, completion: u32, details: bool) -> Self {
        Usage {
            prompt_tokens: prompt,
            total_tokens: u64::from(prompt) + u64::from(completion),
            completion_tokens: completion,
            prompt_tokens_details: details.then_some(None),
        }
    }
}

#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
    stop_reason: Option<()>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Option<()>>,
}

#[derive(Serialize)]
struct CompletionBodyOut<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<CompletionChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<Usage>>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: &'a str,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
    tool_calls: [(); 0],
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<Message<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<Delta<'a>>,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<Option<()>>,
}

#[derive(Serialize)]
struct ChatBodyOut<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChatChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Option<()>>,
}

fn to_json<T: Serialize>(v: &T) -> String {
    // Serializing these plain structs cannot fail; an empty object is a safe fallback.
    serde_json::to_string(v).unwrap_or_else(|_| "{}".into())
}

/// The non-streaming answer, as JSON text.
pub fn full_response(
    endpoint: Endpoint,
    meta: &ResponseMeta,
    text: &str,
    finish_reason: &str,
    prompt: u32,
    completion: u32,
) -> String {
    match endpoint {
        Endpoint::Completions => to_json(&CompletionBodyOut {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices: vec![CompletionChoice {
                index: 0,
                text,
                logprobs: None,
                finish_reason: Some(finish_reason),
                stop_reason: None,
                prompt_logprobs: Some(None),
            }],
            usage: Some(Some(Usage::new(prompt, completion, true))),
        }),
        Endpoint::Chat => to_json(&ChatBodyOut {
            id: &meta.id,
            object: "chat.completion",
            created: meta.created,
            model: &meta.model,
            choices: vec![ChatChoice {
                index: 0,
                message: Some(Message { role: "assistant", content: text, tool_calls: [] }),
                delta: None,
                logprobs: None,
                finish_reason: Some(finish_reason),
                stop_reason: Some(None),
            }],
            usage: Some(Usage::new(prompt, completion, true)),
            prompt_logprobs: Some(None),
        }),
    }
}

/// One SSE event carrying the JSON text `json`.
pub fn sse(json: &str) -> String {
    format!("data: {json}\n\n")
}

/// The stream's terminator.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// The chat stream's first chunk: the assistant role with empty content.
pub fn chat_role_chunk(meta: &ResponseMeta) -> String {
    to_json(&ChatBodyOut {
        id: &meta.id,
        object: "chat.completion.chunk",
        created: meta.created,
        model: &meta.model,
        choices: vec![ChatChoice {
            index: 0,
            message: None,
            delta: Some(Delta { role: Some("assistant"), content: "" }),
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
        }],
        usage: None,
        prompt_logprobs: None,
    })
}

/// A chunk with one token of text; the last one carries the finish reason. Completion chunks
/// always carry `"usage": null` (vLLM dumps them with every field); chat chunks leave it out.
pub fn token_chunk(
    endpoint: Endpoint,
    meta: &ResponseMeta,
    piece: &str,
    finish_reason: Option<&str>,
) -> String {
    match endpoint {
        Endpoint::Completions => to_json(&CompletionBodyOut {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices: vec![CompletionChoice {
                index: 0,
                text: piece,
                logprobs: None,
                finish_reason,
                stop_reason: None,
                prompt_logprobs: None,
            }],
            usage: Some(None),
        }),
        Endpoint::Chat => to_json(&ChatBodyOut {
            id: &meta.id,
            object: "chat.completion.chunk",
            created: meta.created,
            model: &meta.model,
            choices: vec![ChatChoice {
                index: 0,
                message: None,
                delta: Some(Delta { role: None, content: piece }),
                logprobs: None,
                finish_reason,
                stop_reason: finish_reason.map(|_| None),
            }],
            usage: None,
            prompt_logprobs: None,
        }),
    }
}

/// The extra final chunk sent when `stream_options.include_usage` is set: no choices, usage
/// without its null fields.
pub fn usage_chunk(endpoint: Endpoint, meta: &ResponseMeta, prompt: u32, completion: u32) -> String {
    match endpoint {
        Endpoint::Completions => to_json(&CompletionBodyOut {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices: Vec::new(),
            usage: Some(Some(Usage::new(prompt, completion, false))),
        }),
        Endpoint::Chat => to_json(&ChatBodyOut {
            id: &meta.id,
            object: "chat.completion.chunk",
            created: meta.created,
            model: &meta.model,
            choices: Vec::new(),
            usage: Some(Usage::new(prompt, completion, false)),
            prompt_logprobs: None,
        }),
    }
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
            let body: Value = serde_json::from_str(&e.body()).unwrap();
            assert_eq!(body["error"]["code"], 400);
            assert_eq!(body["error"]["type"], "BadRequestError");
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
    fn chunks_have_vllm_shape_and_field_order() {
        let meta = ResponseMeta::new(Endpoint::Chat, 0, 0, 1_700_000_000, "m".into());
        assert!(meta.id.starts_with("chatcmpl-") && meta.id.len() == "chatcmpl-".len() + 32);
        assert_ne!(meta.id, ResponseMeta::new(Endpoint::Chat, 1, 0, 1_700_000_000, "m".into()).id);
        assert_eq!(
            chat_role_chunk(&meta),
            format!(
                r#"{{"id":"{}","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}"#,
                meta.id
            )
        );
        let last: Value =
            serde_json::from_str(&token_chunk(Endpoint::Chat, &meta, " hi", Some("length"))).unwrap();
        assert_eq!(last["choices"][0]["delta"], serde_json::json!({"content": " hi"}));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(last["choices"][0]["stop_reason"].is_null() && last.get("usage").is_none());
        let c = token_chunk(Endpoint::Completions, &meta, "x", None);
        assert!(c.ends_with(r#""choices":[{"index":0,"text":"x","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}"#), "{c}");
        assert_eq!(sse("{}"), "data: {}\n\n");
        let u = usage_chunk(Endpoint::Completions, &meta, 3, 4);
        assert!(
            u.ends_with(
                r#""choices":[],"usage":{"prompt_tokens":3,"total_tokens":7,"completion_tokens":4}}"#
            ),
            "{u}"
        );
        let full = full_response(Endpoint::Completions, &meta, "ab", "stop", 1, 2);
        assert!(full.contains(r#""usage":{"prompt_tokens":1,"total_tokens":3,"completion_tokens":2,"prompt_tokens_details":null}"#), "{full}");
        let e = ApiError::bad_request("no").body();
        assert_eq!(e, r#"{"error":{"message":"no","type":"BadRequestError","param":null,"code":400}}"#);
    }
}
