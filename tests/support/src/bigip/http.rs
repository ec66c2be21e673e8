//! The double's HTTP face: strict path decoding, routing to [`State`], authentication, injected
//! faults, and the request log.
//!
//! Paths are decoded by hand from the raw request line, not by a router, because the exact encoding is
//! part of what the double checks: `~Common~10.1.1.1%252:80` names the route-domain member
//! `10.1.1.1%2:80`, while `~Common~10.1.1.1%2:80` is a malformed escape and gets 400, as any
//! standards-following front end answers it.

use std::sync::{Arc, Mutex, MutexGuard};

use axum::body::Body;
use axum::extract::State as AxState;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use base64::Engine;
use serde_json::{json, Value};

use super::state::{MemberWrite, Reply, ReplyBody, State};
use super::{FaultKind, Recorded, RecordedAuth};

pub type Shared = Arc<Mutex<State>>;

pub fn lock(s: &Shared) -> MutexGuard<'_, State> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn router(state: Shared) -> Router {
    Router::new().fallback(handle).with_state(state)
}

struct Incoming {
    method: String,
    raw_path: String,
    content_type: Option<String>,
    coordination: Option<String>,
    token: Option<String>,
    basic: Option<(String, String)>,
    body: Vec<u8>,
}

async fn handle(AxState(st): AxState<Shared>, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, 4 << 20).await.map(|b| b.to_vec()).unwrap_or_default();
    let headers = &parts.headers;
    let inc = Incoming {
        method: parts.method.as_str().to_string(),
        raw_path: parts.uri.path().to_string(),
        content_type: header(headers, "content-type"),
        coordination: header(headers, "x-f5-rest-coordination-id"),
        token: header(headers, "x-f5-auth-token"),
        basic: basic_auth(headers),
        body,
    };
    let auth = match (&inc.token, &inc.basic) {
        (Some(_), _) => RecordedAuth::Token,
        (None, Some((u, _))) => RecordedAuth::Basic(u.clone()),
        (None, None) => RecordedAuth::None,
    };
    let mut record = Recorded {
        method: inc.method.clone(),
        path: inc.raw_path.clone(),
        query: parts.uri.query().map(str::to_string),
        coordination: inc.coordination.clone(),
        auth,
        status: 0,
        fault: false,
    };

    // A slow management plane: every request waits before it is looked at. Counted while in flight
    // so tests can see how many calls a client overlaps.
    let latency = {
        let mut s = lock(&st);
        s.in_flight += 1;
        s.max_in_flight = s.max_in_flight.max(s.in_flight);
        s.cfg.latency
    };
    let _in_flight = InFlight(st.clone());
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let fault = lock(&st).take_fault(&inc.method, &inc.raw_path);
    let reply = match fault {
        Some(FaultKind::Hang(d)) => {
            // The client gives up first; nothing is applied.
            tokio::time::sleep(d).await;
            Some(Reply::html(503, "Service Unavailable"))
        }
        Some(FaultKind::Delay(d)) => {
            // Do the work late, in a task of its own: the server drops this handler when the client
            // hangs up, but a real BIG-IP finishes what it started even if nobody waits for the
            // answer (the client may have given up and retried meanwhile).
            let st2 = st.clone();
            let mut record = record;
            let late = tokio::spawn(async move {
                tokio::time::sleep(d).await;
                let reply = dispatch(&mut lock(&st2), &inc);
                record.status = reply.status;
                lock(&st2).log.push(record);
                reply
            });
            return match late.await {
                Ok(reply) => into_response(reply),
                Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            };
        }
        // The text BIG-IP sends while mcpd restarts; a public client's tests quote it with
        // `"apiError":32768001`.
        Some(FaultKind::McpdLost) => {
            Some(Reply::tm_error(500, "The connection to mcpd has been lost, try again.", 32_768_001))
        }
        // While restarting, the management server answers 503 with an HTML page.
        Some(FaultKind::Restarting) => Some(Reply::html(503, "Configuration Utility restarting...")),
        Some(FaultKind::Status(status, body)) => Some(Reply { status, body: ReplyBody::Json(body) }),
        None => None,
    };
    record.fault = reply.is_some();
    let reply = match reply {
        Some(r) => r,
        None => dispatch(&mut lock(&st), &inc),
    };
    record.status = reply.status;
    lock(&st).log.push(record);
    into_response(reply)
}

/// Decrements the in-flight count when the request ends, also when the client hung up.
struct InFlight(Shared);

impl Drop for InFlight {
    fn drop(&mut self) {
        lock(&self.0).in_flight -= 1;
    }
}

fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::to_string)
}

fn basic_auth(h: &HeaderMap) -> Option<(String, String)> {
    let v = header(h, "authorization")?;
    let b64 = v.strip_prefix("Basic ")?;
    let raw = base64::engine::general_purpose::STANDARD.decode(b64.trim()).ok()?;
    let raw = String::from_utf8(raw).ok()?;
    let (u, p) = raw.split_once(':')?;
    Some((u.to_string(), p.to_string()))
}

fn into_response(r: Reply) -> Response {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    match r.body {
        ReplyBody::Json(v) => {
            (status, [("content-type", "application/json; charset=UTF-8")], v.to_string()).into_response()
        }
        ReplyBody::Html(h) => {
            (status, [("content-type", "text/html; charset=iso-8859-1")], h).into_response()
        }
        ReplyBody::Empty => status.into_response(),
    }
}

/// Percent-decode one path segment, refusing malformed escapes (`%2:`) and non-UTF-8.
fn decode_segment(seg: &str) -> Option<String> {
    let b = seg.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// `~Common~llm_pool` -> `/Common/llm_pool`; a bare name lives in `Common`.
fn pool_ref(seg: &str) -> String {
    match seg.strip_prefix('~') {
        Some(rest) => format!("/{}", rest.replace('~', "/")),
        None => format!("/Common/{seg}"),
    }
}

/// `~Common~10.1.1.1:80` -> (`Common`, `10.1.1.1:80`).
fn member_ref(seg: &str) -> (String, String) {
    match seg.strip_prefix('~').and_then(|r| r.split_once('~')) {
        Some((partition, name)) => (partition.to_string(), name.to_string()),
        None => ("Common".to_string(), seg.to_string()),
    }
}

fn not_registered(s: &mut State, path: &str) -> Reply {
    // Wording seen in public client tests for a path iControl REST does not serve.
    let op = s.next_op();
    Reply::rest_error(
        404,
        format!("URI path {path} not registered.  Please verify URI is supported and wait for /available suffix to be responsive."),
        op,
    )
}

fn not_allowed(s: &mut State, method: &str, path: &str) -> Reply {
    let op = s.next_op();
    Reply::rest_error(405, format!("method {method} is not supported on {path}"), op)
}

/// The JSON body of a write. BIG-IP insists on the JSON content type: without it the answer is
/// 400 "Found invalid content-type. The content-type must be application/json. ..."
fn json_body(inc: &Incoming) -> Result<Value, Reply> {
    let ct = inc.content_type.clone().unwrap_or_default();
    if !ct.to_ascii_lowercase().starts_with("application/json") {
        return Err(Reply::tm_error(
            400,
            format!("Found invalid content-type. The content-type must be application/json. The received content-type is {ct}"),
            1,
        ));
    }
    if inc.body.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(&inc.body)
        .map_err(|e| Reply::tm_error(400, format!("Unexpected content in the JSON request body: {e}"), 1))
}

fn dispatch(s: &mut State, inc: &Incoming) -> Reply {
    let Some(segs) = inc.raw_path.split('/').skip(1).map(decode_segment).collect::<Option<Vec<String>>>()
    else {
        return Reply::html(
            400,
            "Bad Request: your browser sent a request that this server could not understand.",
        );
    };
    let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
    let m = inc.method.as_str();
    let path = inc.raw_path.as_str();
    let writes = matches!(m, "POST" | "PATCH" | "PUT");
    let body = if writes {
        match json_body(inc) {
            Ok(b) => b,
            Err(r) => return r,
        }
    } else {
        Value::Null
    };

    if segs == ["mgmt", "shared", "authn", "login"] {
        return if m == "POST" { s.login(&body) } else { not_allowed(s, m, path) };
    }
    let user = match s.authenticate(inc.token.as_deref(), inc.basic.clone(), path) {
        Ok(u) => u,
        Err(r) => return r,
    };
    let coordination = match inc.coordination.as_deref().map(str::parse::<u64>) {
        None => None,
        Some(Ok(id)) => Some(id),
        Some(Err(_)) => {
            let op = s.next_op();
            return Reply::rest_error(400, "X-F5-REST-Coordination-Id must be a transaction id", op);
        }
    };
    let is_member_write = matches!(segs.as_slice(), ["mgmt", "tm", "ltm", "pool", _, "members", _])
        && matches!(m, "PATCH" | "PUT");
    let is_commit = matches!(segs.as_slice(), ["mgmt", "tm", "transaction", _]) && m == "PATCH";
    if let Some(id) = coordination {
        if !is_member_write && !is_commit {
            let op = s.next_op();
            return Reply::rest_error(
                400,
                format!("Transaction {id} operation {m} https://localhost{path} is not allowed to be added to transaction."),
                op,
            );
        }
    }

    match (segs.as_slice(), m) {
        (["mgmt", "shared", "authz", "tokens", tok], _) => s.token_op(&user, m, tok, Some(&body)),
        (["mgmt", "tm", "cm", "failover-status"], "GET") => s.failover_status(),
        (["mgmt", "tm", "transaction"], "POST") => s.txn_create(&user),
        (["mgmt", "tm", "transaction"], "GET") => s.txn_list(),
        (["mgmt", "tm", "transaction", id, rest @ ..], _) => {
            let Ok(id) = id.parse::<u64>() else {
                return not_registered(s, path);
            };
            match (rest, m) {
                ([], "GET") => s.txn_get(id),
                ([], "PATCH") => s.txn_commit(&user, id, &body, coordination.is_some()),
                ([], "DELETE") => s.txn_delete(id),
                (["commands"], "GET") => s.txn_commands(id),
                ([] | ["commands"], _) => not_allowed(s, m, path),
                _ => not_registered(s, path),
            }
        }
        (["mgmt", "tm", "ltm", "pool"], "GET") => s.pools_get(),
        (["mgmt", "tm", "ltm", "pool", p], "GET") => s.pool_get(&pool_ref(p)),
        (["mgmt", "tm", "ltm", "pool", p], "PATCH") => s.pool_patch(&user, &pool_ref(p), &body),
        (["mgmt", "tm", "ltm", "pool", p, "members"], "GET") => s.members_get(&pool_ref(p)),
        (["mgmt", "tm", "ltm", "pool", p, "members", mem], _) => {
            let (pool, member) = (pool_ref(p), member_ref(mem));
            match m {
                "GET" => s.member_get(&pool, &member),
                "PATCH" | "PUT" => s.member_write(&MemberWrite {
                    user: &user,
                    method: m,
                    pool: &pool,
                    member: &member,
                    body: &body,
                    coordination,
                    uri: path,
                }),
                "DELETE" => s.member_delete(&user, &pool, &member),
                _ => not_allowed(s, m, path),
            }
        }
        (["mgmt", "tm", "ltm", "pool", ..], _) | (["mgmt", "tm", "transaction"], _) => {
            not_allowed(s, m, path)
        }
        _ => not_registered(s, path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_decoding() {
        assert_eq!(decode_segment("~Common~10.1.1.1%252:80").as_deref(), Some("~Common~10.1.1.1%2:80"));
        assert_eq!(decode_segment("~Common~10.1.1.1%2:80"), None);
        assert_eq!(decode_segment("abc%"), None);
        assert_eq!(decode_segment("%ff"), None);
    }

    #[test]
    fn refs() {
        assert_eq!(pool_ref("~Common~llm_pool"), "/Common/llm_pool");
        assert_eq!(pool_ref("~T~app.app~p"), "/T/app.app/p");
        assert_eq!(pool_ref("llm_pool"), "/Common/llm_pool");
        assert_eq!(member_ref("~Common~2001:db8::1.80"), ("Common".into(), "2001:db8::1.80".into()));
        assert_eq!(member_ref("10.1.1.1:80"), ("Common".into(), "10.1.1.1:80".into()));
    }
}
