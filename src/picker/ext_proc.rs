//! The Envoy door: Envoy's external processing gRPC API spoken as the Gateway API Inference
//! Extension's endpoint-picker protocol (v1.0.0), so the picker is a drop-in endpoint picker (EPP)
//! for every gateway of that extension, and for plain Envoy.
//!
//! One gRPC stream per HTTP request. With the protocol's processing mode (headers SEND, bodies
//! `FULL_DUPLEX_STREAMED`, trailers SEND):
//! - the answer to the request headers is held until the body has ended (at once when the headers
//!   end the request), then sent with `clear_route_cache`, the header
//!   `x-gateway-destination-endpoint: ip:port[,ip:port...]` (the pick, then fallbacks in order)
//!   and the same value in the dynamic metadata `envoy.lb`; the body follows, streamed back in
//!   chunks of at most [`CHUNK`] bytes (in this mode Envoy forwards only what the processor sends);
//! - with a `BUFFERED` request body the headers are let through at once and the pick rides on the
//!   answer to the body (a body answer may still change the request's headers);
//! - a client's own `x-gateway-destination-endpoint` is always overwritten, never obeyed;
//! - a subset hint (`envoy.lb.subset_hint` metadata) limits the pick; none of it in the pool: 503;
//! - the response headers are the request's first token (its prefill no longer loads the
//!   member); the data plane's `x-gateway-destination-endpoint-served` (metadata `envoy.lb`) moves
//!   the request's load where it really went; the stream's end, however it ends, finishes it;
//! - nobody to pick (no members yet): 503 as an immediate response; a request whose
//!   `x-criticality` is `sheddable` while every endpoint is saturated: 429.

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::{HttpStatus, StatusCode};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse, CommonResponse,
    HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use futures::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::pool::{Ask, NoPick, PoolPicker, Settle};
use super::PickCounter;

/// The header (and `envoy.lb` metadata key) naming the pick and its fallbacks.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata key the data plane reports the endpoint it used under.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the pick (and of the served report).
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace and key of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// A client's session or prefix key (the reference proxy's header).
pub const KEY_HEADER: &str = "x-llm-prefix-key";
/// A request's criticality (the reference proxy's header): `sheddable` ones are refused with 429
/// while every endpoint is saturated.
pub const CRITICALITY_HEADER: &str = "x-criticality";
/// The largest body chunk sent back, as the protocol's reference implementation sends them.
pub const CHUNK: usize = 62_000;
/// A request body larger than this is refused (413): it is held whole until the pick.
pub const MAX_BODY: usize = 64 << 20;

type Out = Result<ProcessingResponse, Status>;

/// The gRPC service for one pool.
#[derive(Clone)]
pub struct Door {
    pool: Arc<PoolPicker>,
    counter: PickCounter,
}

impl Door {
    pub fn new(pool: Arc<PoolPicker>, counter: PickCounter) -> Door {
        Door { pool, counter }
    }

    pub fn server(self) -> ExternalProcessorServer<Door> {
        ExternalProcessorServer::new(self)
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Door {
    type ProcessStream = Pin<Box<dyn Stream<Item = Out> + Send + 'static>>;

    async fn process(
        &self,
        req: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // The answers are produced as Envoy's messages are read, in the task that serves the
        // stream: no task or channel of its own per request.
        let exchange = Exchange::new(self.pool.clone(), self.counter.clone());
        let answers = futures::stream::unfold(
            (exchange, req.into_inner(), None::<Release>, false),
            |(mut ex, mut inbound, mut release, mut over)| async move {
                loop {
                    if let Some(msg) = ex.out.pop_front() {
                        return Some((Ok(msg), (ex, inbound, release, over)));
                    }
                    if over {
                        // Dropping `release` here (or with the stream, if Envoy goes first)
                        // settles the pick.
                        return None;
                    }
                    match inbound.message().await {
                        Ok(Some(m)) => over = !ex.handle(m),
                        // The stream ended or broke: the request is over either way.
                        Ok(None) | Err(_) => over = true,
                    }
                    if let (None, Some(id)) = (&release, ex.picked) {
                        release = Some(Release(ex.pool.clone(), id));
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(answers)))
    }
}

/// One HTTP request's exchange with Envoy.
struct Exchange {
    pool: Arc<PoolPicker>,
    counter: PickCounter,
    /// Answers not yet sent, in order.
    out: VecDeque<ProcessingResponse>,
    key: Option<Vec<u8>>,
    sheddable: bool,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// Whether the request body comes streamed back through us (full duplex) or stays with Envoy.
    duplex: bool,
    /// The same for the response body.
    response_duplex: bool,
    /// The pick's id, once picked (the request is then answered): settled when the exchange ends.
    picked: Option<u64>,
}

/// What follows the answer to the request headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    /// The headers ended the request.
    NoBody,
    /// The body, ending with its last chunk.
    BodyEnds,
    /// The body so far, then the request trailers.
    TrailersFollow,
}

/// Releases the pick however the exchange ends (Envoy closed the stream, the client left).
struct Release(Arc<PoolPicker>, u64);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.finished(self.1);
    }
}

impl Exchange {
    fn new(pool: Arc<PoolPicker>, counter: PickCounter) -> Exchange {
        Exchange {
            pool,
            counter,
            out: VecDeque::new(),
            key: None,
            sheddable: false,
            subset: None,
            body: Vec::new(),
            duplex: true,
            response_duplex: true,
            picked: None,
        }
    }

    /// Queue an answer (sent in order as the stream is polled).
    fn send(&mut self, response: processing_response::Response, metadata: Option<Struct>) {
        let msg =
            ProcessingResponse { response: Some(response), dynamic_metadata: metadata, ..Default::default() };
        self.out.push_back(msg);
    }

    /// One message from Envoy; `false` ends the exchange.
    fn handle(&mut self, msg: ProcessingRequest) -> bool {
        use processing_request::Request as In;
        if let Some(pc) = &msg.protocol_config {
            self.duplex = pc.request_body_mode == BodySendMode::FullDuplexStreamed as i32;
            self.response_duplex = pc.response_body_mode == BodySendMode::FullDuplexStreamed as i32;
        }
        match msg.request {
            Some(In::RequestHeaders(h)) => {
                self.subset = subset_hint(msg.metadata_context.as_ref());
                self.key = header(&h, KEY_HEADER).filter(|k| !k.is_empty());
                self.sheddable =
                    header(&h, CRITICALITY_HEADER).is_some_and(|v| v.eq_ignore_ascii_case(b"sheddable"));
                if h.end_of_stream {
                    return self.pick_and_answer(Then::NoBody);
                }
                // Full duplex: held, the answer goes once the body has ended. Buffered: the body
                // comes as one message and its answer carries the pick.
                if !self.duplex {
                    self.send(
                        processing_response::Response::RequestHeaders(HeadersResponse::default()),
                        None,
                    );
                }
                true
            }
            Some(In::RequestBody(b)) => {
                if self.body.len() + b.body.len() > MAX_BODY {
                    return self.immediate(
                        StatusCode::PayloadTooLarge,
                        "request body too large for the endpoint picker",
                    );
                }
                self.body.extend_from_slice(&b.body);
                if !self.duplex || b.end_of_stream {
                    return self.pick_and_answer(Then::BodyEnds);
                }
                true
            }
            Some(In::RequestTrailers(_)) => {
                // A body that ended with trailers: pick now, send the body on, then the trailers.
                if self.picked.is_none() && !self.pick_and_answer(Then::TrailersFollow) {
                    return false;
                }
                self.send(processing_response::Response::RequestTrailers(TrailersResponse::default()), None);
                true
            }
            Some(In::ResponseHeaders(_)) => {
                if let Some(id) = self.picked {
                    if let Some(served) = served(msg.metadata_context.as_ref()) {
                        if let Some(as_picked) = self.pool.served(id, &served) {
                            self.counter.served(&self.pool.name, as_picked);
                        }
                    }
                    self.pool.first_token(id);
                }
                self.send(processing_response::Response::ResponseHeaders(HeadersResponse::default()), None);
                true
            }
            Some(In::ResponseBody(b)) => {
                // Full duplex: what we send is what the client gets; echo each chunk at once.
                let end = b.end_of_stream;
                if self.response_duplex {
                    self.stream_back(b.body, end, false);
                } else {
                    self.send(processing_response::Response::ResponseBody(BodyResponse::default()), None);
                }
                if let Some(id) = self.picked.filter(|_| end) {
                    self.pool.finished(id);
                }
                true
            }
            Some(In::ResponseTrailers(_)) => {
                self.send(processing_response::Response::ResponseTrailers(TrailersResponse::default()), None);
                true
            }
            None => true,
        }
    }

    /// Pick, then answer the held headers (full duplex) or the buffered body, and send the body
    /// back (full duplex) as `then` says.
    fn pick_and_answer(&mut self, then: Then) -> bool {
        let ask = Ask {
            body: &self.body,
            key: self.key.as_deref(),
            subset: self.subset.as_deref(),
            sheddable: self.sheddable,
            with_fallbacks: true,
        };
        let pick = match self.pool.pick(ask, Settle::Tracked) {
            Ok(p) => p,
            Err(why) => {
                self.counter.count(&self.pool.name, "ext_proc", outcome(why));
                let (code, what) = match why {
                    NoPick::NoMembers => {
                        (StatusCode::ServiceUnavailable, "no endpoint to pick: the pool has no members yet")
                    }
                    NoPick::OutsideSubset => {
                        (StatusCode::ServiceUnavailable, "no endpoint of the pool is in the subset hint")
                    }
                    NoPick::Shed => (
                        StatusCode::TooManyRequests,
                        "every endpoint is saturated: sheddable request refused",
                    ),
                };
                return self.immediate(code, what);
            }
        };
        self.counter.count(&self.pool.name, "ext_proc", "picked");
        self.picked = Some(pick.id);
        let value = pick.endpoints.join(",");
        let common = CommonResponse {
            clear_route_cache: true,
            header_mutation: Some(HeaderMutation {
                set_headers: vec![HeaderValueOption {
                    header: Some(HeaderValue {
                        key: DESTINATION.into(),
                        raw_value: value.clone().into_bytes(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let metadata = lb_metadata(&value);
        if !self.duplex {
            let answer = processing_response::Response::RequestBody(BodyResponse { response: Some(common) });
            self.send(answer, Some(metadata));
            return true;
        }
        let answer =
            processing_response::Response::RequestHeaders(HeadersResponse { response: Some(common) });
        self.send(answer, Some(metadata));
        let body = std::mem::take(&mut self.body);
        match then {
            Then::NoBody => {}
            Then::BodyEnds => self.stream_back(body, true, true),
            Then::TrailersFollow if body.is_empty() => {}
            Then::TrailersFollow => self.stream_back(body, false, true),
        }
        true
    }

    /// Send `body` back in chunks of at most [`CHUNK`] bytes (one empty chunk for an empty body),
    /// the last marked `end` when `end`; a body of one chunk is moved, not copied.
    fn stream_back(&mut self, body: Vec<u8>, end: bool, request: bool) {
        let chunks: Vec<Vec<u8>> =
            if body.len() <= CHUNK { vec![body] } else { body.chunks(CHUNK).map(<[u8]>::to_vec).collect() };
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let streamed =
                StreamedBodyResponse { body: chunk, end_of_stream: end && i == last, ..Default::default() };
            let common = CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::StreamedResponse(streamed)),
                }),
                ..Default::default()
            };
            let answer = BodyResponse { response: Some(common) };
            let msg = if request {
                processing_response::Response::RequestBody(answer)
            } else {
                processing_response::Response::ResponseBody(answer)
            };
            self.send(msg, None);
        }
    }

    /// Answer Envoy itself with `code` and a JSON error; the exchange ends (`false`).
    fn immediate(&mut self, code: StatusCode, message: &str) -> bool {
        let body = serde_json::to_vec(&serde_json::json!({"error": message})).unwrap_or_default();
        let answer = ImmediateResponse {
            status: Some(HttpStatus { code: code as i32 }),
            headers: Some(HeaderMutation {
                set_headers: vec![HeaderValueOption {
                    header: Some(HeaderValue {
                        key: "content-type".into(),
                        raw_value: b"application/json".to_vec(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            body,
            ..Default::default()
        };
        self.send(processing_response::Response::ImmediateResponse(answer), None);
        false
    }
}

fn outcome(why: NoPick) -> &'static str {
    match why {
        NoPick::NoMembers => "no_members",
        NoPick::OutsideSubset => "outside_subset",
        NoPick::Shed => "shed",
    }
}

/// A request header's bytes (Envoy sends `raw_value`; older ones `value`).
fn header(h: &HttpHeaders, name: &str) -> Option<Vec<u8>> {
    let map = h.headers.as_ref()?;
    let hv = map.headers.iter().find(|hv| hv.key.eq_ignore_ascii_case(name))?;
    Some(if hv.raw_value.is_empty() { hv.value.clone().into_bytes() } else { hv.raw_value.clone() })
}

fn string_value(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.to_string())) }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": value}}`.
fn lb_metadata(value: &str) -> Struct {
    let inner = Struct {
        fields: BTreeMap::from([(DESTINATION.to_string(), string_value(value))]).into_iter().collect(),
    };
    Struct {
        fields: BTreeMap::from([(LB_NAMESPACE.to_string(), Value { kind: Some(Kind::StructValue(inner)) })])
            .into_iter()
            .collect(),
    }
}

/// The subset hint: a list of `ip[:port]` strings, or one comma-separated string (each list item
/// may be comma-separated too). `None` when absent; an empty list is an empty subset.
fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let value = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?.fields.get(SUBSET_KEY)?;
    let split = |s: &str| {
        s.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect::<Vec<_>>()
    };
    match value.kind.as_ref()? {
        Kind::StringValue(s) => Some(split(s)),
        Kind::ListValue(l) => Some(
            l.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(split(s)),
                    _ => None,
                })
                .flatten()
                .collect(),
        ),
        _ => None,
    }
}

/// The endpoint the data plane reports it used (`envoy.lb` / `x-gateway-destination-endpoint-served`).
fn served(metadata: Option<&Metadata>) -> Option<String> {
    let value = metadata?.filter_metadata.get(LB_NAMESPACE)?.fields.get(SERVED)?;
    match value.kind.as_ref()? {
        Kind::StringValue(s) => s.split(',').next().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()),
        _ => None,
    }
}
