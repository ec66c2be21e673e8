//! One authenticated conversation with one BIG-IP, shared by every pool the controller pushes to it.
//!
//! Token rules this module follows (F5's iControl REST user guide and the DevCentral article
//! "iControl REST Authentication Token Management", restated):
//! - `POST /mgmt/shared/authn/login {"username","password","loginProviderName"}` answers
//!   `{"token": {"token": "...", "timeout": 1200, ...}}`; the token travels in `X-F5-Auth-Token`;
//! - a token lives `timeout` seconds from its start (1200 by default); `PATCH
//!   /mgmt/shared/authz/tokens/TOKEN {"timeout": N}` lengthens that, up to 36000 seconds in all;
//! - each user may hold 100 live tokens (the built-in `admin` excepted); the 101st login is refused
//!   with 400 "... has reached maximum active login tokens", so clients must reuse and delete tokens;
//! - `DELETE /mgmt/shared/authz/tokens/TOKEN` revokes one; a revoked or expired token gets 401.
//! - basic auth (`Authorization: Basic`) works for local users only.
//!
//! Hence: one session per (URL, user, TLS settings) in the whole process, one token per session,
//! extended before it runs out, replaced (and the old one deleted) when it cannot be extended, logged
//! in again once on a 401, and deleted when the last sink using it shuts down.
//!
//! Two kinds of 401 are told apart by BIG-IP's message: `Authorization failed: user=... resource=...`
//! means the token is fine but the user's role may not do this (logging in again would not help),
//! anything else means the token is gone. Refused credentials are not sent again until the
//! [`LoginGate`] allows it or the password changes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use base64::Engine;
use rand::Rng;
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::config::{AuthMode, F5Config};
use super::login_gate::{LoginGate, Verdict};
use super::wire;
use crate::{SecretRef, SinkError};

/// The longest lifetime BIG-IP lets a token reach, counted from its start.
const MAX_TOKEN_TIMEOUT: Duration = Duration::from_secs(36_000);
/// Header carrying the token.
const TOKEN_HEADER: &str = "X-F5-Auth-Token";
/// Header that queues a request into a transaction instead of running it.
pub const COORDINATION_HEADER: &str = "X-F5-REST-Coordination-Id";

/// How hard one call tries.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub retries: u32,
    pub backoff: Duration,
}

impl RetryPolicy {
    pub fn none() -> Self {
        RetryPolicy { retries: 0, backoff: Duration::ZERO }
    }

    /// Exponential backoff with jitter: attempt 0 waits about `backoff`, then 2x, 4x ..., capped at
    /// 5 s; the wait is drawn from the upper half of that so retries of several sinks spread out.
    pub(super) fn delay(&self, attempt: u32) -> Duration {
        let full = self.backoff.saturating_mul(1u32 << attempt.min(16)).min(Duration::from_secs(5));
        let half = full / 2;
        half + full.mul_f64(rand::thread_rng().gen_range(0.0..0.5))
    }
}

/// Why a call failed, before the sink names the pool and member it concerns.
#[derive(Debug)]
pub enum CallError {
    /// No HTTP answer: connection refused, TLS failure, timeout.
    Transport(String),
    /// An HTTP error answer, with BIG-IP's `code`/`message` when the body had them.
    Http { status: u16, message: String },
    /// Credentials missing, unreadable or refused.
    Auth(String),
    /// A 2xx answer we could not read.
    Decode(String),
}

impl CallError {
    pub fn retryable(&self) -> bool {
        match self {
            CallError::Transport(_) => true,
            CallError::Http { status, .. } => *status == 429 || (500..600).contains(status),
            CallError::Auth(_) | CallError::Decode(_) => false,
        }
    }

    /// One line for logs and combined messages.
    pub fn summary(&self) -> String {
        match self {
            CallError::Auth(m) | CallError::Transport(m) | CallError::Decode(m) => m.clone(),
            CallError::Http { status, message } => format!("HTTP {status}: {message}"),
        }
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            CallError::Http { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Turn into the crate's error, naming what was being changed.
    pub fn into_sink_error(self, target: String) -> SinkError {
        match self {
            CallError::Transport(detail) => SinkError::Unreachable { target, detail },
            CallError::Http { status, message } if is_permission_denial(status, &message) => {
                SinkError::Forbidden { target, detail: format!("HTTP {status}: {message}") }
            }
            CallError::Http { status, message } => {
                let detail = format!("HTTP {status}: {message}");
                match status {
                    401 | 403 => SinkError::Auth { target, detail },
                    429 | 500..=599 => SinkError::Temporary { target, detail },
                    _ => SinkError::Rejected { target, detail },
                }
            }
            CallError::Auth(detail) => SinkError::Auth { target, detail },
            CallError::Decode(detail) => SinkError::Rejected { target, detail },
        }
    }
}

/// BIG-IP answers a request its user's role does not allow with 401 `Authorization failed: user=...
/// resource=... verb=...` (iControl REST RBAC) or 403; an expired or unknown token gets 401 with
/// another message.
fn is_permission_denial(status: u16, message: &str) -> bool {
    status == 403 || (status == 401 && message.contains("Authorization failed"))
}

/// One request, described before it is sent (so it can be sent again).
pub struct Request<'a> {
    pub method: Method,
    /// Path below the base URL, already encoded, e.g. `/mgmt/tm/ltm/pool/~Common~p/members`.
    pub path: &'a str,
    pub body: Option<Value>,
    /// Queue into this transaction instead of running now.
    pub coordination: Option<u64>,
}

impl<'a> Request<'a> {
    pub fn get(path: &'a str) -> Self {
        Request { method: Method::GET, path, body: None, coordination: None }
    }

    pub fn with_body(method: Method, path: &'a str, body: Value) -> Self {
        Request { method, path, body: Some(body), coordination: None }
    }
}

/// What makes two sinks able to share a session.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SessionKey {
    url: String,
    username: String,
    login_provider: String,
    auth: AuthMode,
    ca_file: Option<std::path::PathBuf>,
    pinned_cert: Option<std::path::PathBuf>,
    insecure: bool,
    timeout: Duration,
    login_backoff: Duration,
}

fn registry() -> &'static Mutex<HashMap<SessionKey, Weak<Session>>> {
    static REGISTRY: std::sync::OnceLock<Mutex<HashMap<SessionKey, Weak<Session>>>> =
        std::sync::OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A live token and what we know of its lifetime, measured on our own clock from just before the
/// login request left (so we always think it expires a little earlier than BIG-IP does).
struct Token {
    value: String,
    started: Instant,
    /// Current lifetime from `started`.
    timeout: Duration,
    /// The lifetime BIG-IP gave at login; each extension adds about this much.
    initial: Duration,
}

impl Token {
    fn expires(&self) -> Instant {
        self.started + self.timeout
    }

    /// Renew this long before expiry: a quarter of the lifetime, at most a minute.
    fn margin(&self) -> Duration {
        (self.initial / 4).min(Duration::from_secs(60))
    }
}

/// Shared state of one BIG-IP conversation.
pub struct Session {
    key: SessionKey,
    base: String,
    client: reqwest::Client,
    password: SecretRef,
    token: tokio::sync::Mutex<Option<Token>>,
    /// When refused credentials may be sent again.
    gate: Mutex<LoginGate>,
    /// Sinks using this session that have not shut down yet.
    holders: AtomicUsize,
}

impl Session {
    /// The session with the unit at `url` for this config, shared with every other sink pointing at
    /// the same BIG-IP as the same user. The caller holds one "holder" count until it calls
    /// [`Session::release`].
    pub fn shared(cfg: &F5Config, url: &str, username: String) -> Result<Arc<Session>, SinkError> {
        let key = SessionKey {
            url: url.trim_end_matches('/').to_string(),
            username,
            login_provider: cfg.login_provider.clone(),
            auth: cfg.auth,
            ca_file: cfg.ca_file.clone(),
            pinned_cert: cfg.pinned_cert.clone(),
            insecure: cfg.insecure_skip_verify,
            timeout: cfg.timeout,
            login_backoff: cfg.login_backoff,
        };
        let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        reg.retain(|_, w| w.strong_count() > 0);
        if let Some(s) = reg.get(&key).and_then(Weak::upgrade) {
            s.holders.fetch_add(1, Ordering::SeqCst);
            return Ok(s);
        }
        let session = Arc::new(Session {
            base: key.url.clone(),
            client: build_client(cfg, &key.url)?,
            password: cfg.password.clone(),
            token: tokio::sync::Mutex::new(None),
            gate: Mutex::new(LoginGate::new(cfg.login_backoff)),
            holders: AtomicUsize::new(1),
            key: key.clone(),
        });
        reg.insert(key, Arc::downgrade(&session));
        Ok(session)
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    pub fn username(&self) -> &str {
        &self.key.username
    }

    /// Send a request, authenticating as configured, retrying what is worth retrying, and logging in
    /// again once if BIG-IP says the token is no longer valid. Answers are parsed as `T`.
    pub async fn call<T: DeserializeOwned>(
        &self,
        req: &Request<'_>,
        policy: RetryPolicy,
    ) -> Result<T, CallError> {
        let mut attempt = 0;
        let mut logged_in_again = false;
        loop {
            let failure = match self.auth().await {
                Ok(auth) => match (self.send(req, Some(&auth)).await, &auth) {
                    (Ok(v), _) => return decode(v),
                    (Err(CallError::Http { status: 401, message }), Auth::Token(t))
                        if !logged_in_again && !is_permission_denial(401, &message) =>
                    {
                        // The token expired or was revoked behind our back (BIG-IP restart, someone
                        // deleting tokens). Log in again once; a second 401 is a real refusal.
                        logged_in_again = true;
                        self.replace_token(t, message.contains("does not exist")).await?;
                        continue;
                    }
                    (Err(CallError::Http { status: 401, message }), Auth::Basic(_, sent))
                        if !is_permission_denial(401, &message) =>
                    {
                        // Basic auth sends the password every time: a refusal counts like a refused
                        // login against lockout policies.
                        return Err(self.refused(message, *sent));
                    }
                    (Err(e), _) => e,
                },
                Err(e) => e,
            };
            if failure.retryable() && attempt < policy.retries {
                let wait = policy.delay(attempt);
                tracing::debug!(bigip = %self.base, path = %redact(req.path), error = ?failure, ?wait, "retrying");
                attempt += 1;
                tokio::time::sleep(wait).await;
                continue;
            }
            return Err(failure);
        }
    }

    /// One HTTP exchange. `Ok` holds the parsed JSON of a 2xx answer (`Null` for an empty body).
    async fn send(&self, req: &Request<'_>, auth: Option<&Auth>) -> Result<Value, CallError> {
        let url = format!("{}{}", self.base, req.path);
        let mut rb = self.client.request(req.method.clone(), &url).header("Accept", "application/json");
        match auth {
            Some(Auth::Basic(h, _)) => rb = rb.header("Authorization", h),
            Some(Auth::Token(t)) => rb = rb.header(TOKEN_HEADER, t),
            None => {}
        }
        if let Some(id) = req.coordination {
            rb = rb.header(COORDINATION_HEADER, id.to_string());
        }
        if let Some(body) = &req.body {
            // BIG-IP refuses bodies not labelled application/json; `.json()` sets the header.
            rb = rb.json(body);
        }
        let resp = rb.send().await.map_err(|e| CallError::Transport(describe_reqwest(e)))?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| CallError::Transport(describe_reqwest(e)))?;
        if status.is_success() {
            if bytes.iter().all(u8::is_ascii_whitespace) {
                return Ok(Value::Null);
            }
            return serde_json::from_slice(&bytes).map_err(|e| {
                CallError::Decode(format!("{} {}: answer is not JSON: {e}", req.method, redact(req.path)))
            });
        }
        Err(CallError::Http { status: status.as_u16(), message: error_message(status, &bytes) })
    }

    /// The credentials to attach to the next request, logging in or renewing the token if needed.
    async fn auth(&self) -> Result<Auth, CallError> {
        match self.key.auth {
            AuthMode::Basic => {
                let password = self.password.resolve().map_err(CallError::Auth)?;
                let sent = self.may_send(&password)?;
                let raw = format!("{}:{}", self.key.username, password);
                Ok(Auth::Basic(
                    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(raw)),
                    sent,
                ))
            }
            AuthMode::Token => self.token().await.map(Auth::Token),
        }
    }

    /// A token good for at least its renewal margin: reuse, extend, or replace.
    async fn token(&self) -> Result<String, CallError> {
        let mut slot = self.token.lock().await;
        let now = Instant::now();
        if let Some(t) = slot.as_mut() {
            if now + t.margin() < t.expires() {
                return Ok(t.value.clone());
            }
            if now < t.expires() {
                // Lengthen the same token rather than piling up new ones: ask for another full
                // lifetime from now, within BIG-IP's absolute cap.
                let wanted = (now - t.started + t.initial).min(MAX_TOKEN_TIMEOUT);
                let wanted = Duration::from_secs(wanted.as_secs());
                if wanted > t.timeout {
                    match self.extend(&t.value, wanted).await {
                        Ok(()) => {
                            tracing::debug!(bigip = %self.base, timeout_s = wanted.as_secs(), "extended BIG-IP token");
                            t.timeout = wanted;
                            return Ok(t.value.clone());
                        }
                        Err(e) => {
                            tracing::debug!(bigip = %self.base, error = %hide(&e, &t.value), "token extension refused; logging in anew")
                        }
                    }
                }
                let old = slot.take();
                let fresh = self.login().await;
                if let Some(old) = old {
                    // Delete the old token so it does not count against the user's live tokens.
                    self.delete_token(&old.value).await;
                }
                let fresh = fresh?;
                let value = fresh.value.clone();
                *slot = Some(fresh);
                return Ok(value);
            }
            // Already expired: BIG-IP no longer counts it, and it cannot be used to delete itself.
            *slot = None;
        }
        let fresh = self.login().await?;
        let value = fresh.value.clone();
        *slot = Some(fresh);
        Ok(value)
    }

    /// After a 401 with `used`: drop it and log in again, unless another task already did. Unless
    /// BIG-IP said the token no longer exists, delete it first: a token refused for another reason
    /// may still be alive and would count against the user's limit.
    async fn replace_token(&self, used: &str, dead: bool) -> Result<(), CallError> {
        let mut slot = self.token.lock().await;
        if slot.as_ref().is_some_and(|t| t.value != used) {
            return Ok(());
        }
        if let Some(old) = slot.take() {
            if !dead {
                self.delete_token(&old.value).await;
            }
        }
        tracing::info!(bigip = %self.base, user = %self.key.username, "BIG-IP refused the token; logging in again");
        *slot = Some(self.login().await?);
        Ok(())
    }

    async fn login(&self) -> Result<Token, CallError> {
        let password = self.password.resolve().map_err(CallError::Auth)?;
        let sent = self.may_send(&password)?;
        let body = serde_json::to_value(wire::LoginRequest {
            username: &self.key.username,
            password: &password,
            login_provider_name: &self.key.login_provider,
        })
        .map_err(|e| CallError::Decode(e.to_string()))?;
        let req = Request::with_body(Method::POST, "/mgmt/shared/authn/login", body);
        let started = Instant::now();
        let mut attempt = 0;
        let policy = RetryPolicy { retries: 2, backoff: Duration::from_millis(200) };
        let answer = loop {
            match self.send(&req, None).await {
                Ok(v) => break v,
                Err(e) if e.retryable() && attempt < policy.retries => {
                    attempt += 1;
                    tokio::time::sleep(policy.delay(attempt)).await;
                }
                Err(CallError::Http { status: 401, message }) => return Err(self.refused(message, sent)),
                Err(e) => return Err(login_error(e, &self.key.username)),
            }
        };
        let after = self.gate.lock().unwrap_or_else(|p| p.into_inner()).accepted();
        if after > 0 {
            tracing::warn!(bigip = %self.base, user = %self.key.username, refusals = after, "BIG-IP accepts the credentials again");
        }
        let parsed: wire::LoginResponse = serde_json::from_value(answer)
            .map_err(|e| CallError::Decode(format!("login answer has no token.token/token.timeout: {e}")))?;
        let lifetime = Duration::from_secs(parsed.token.timeout.max(1));
        tracing::info!(bigip = %self.base, user = %self.key.username, lifetime_s = lifetime.as_secs(), "logged in to BIG-IP");
        Ok(Token { value: parsed.token.token, started, timeout: lifetime, initial: lifetime })
    }

    /// Refuse to send credentials BIG-IP refused before, until the wait is over or they change.
    /// Returns the fingerprint of the credentials about to be sent.
    fn may_send(&self, password: &str) -> Result<u64, CallError> {
        let sent = fingerprint(&self.key.username, password);
        let gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        match gate.check(Instant::now(), sent) {
            Verdict::Try => Ok(sent),
            Verdict::Wait { remaining, refusals } => Err(CallError::Auth(format!(
                "BIG-IP refused the credentials of user {:?} {refusals} time(s); not sending them again for \
                 {}s (or as soon as the password changes), so the account is not locked out",
                self.key.username,
                remaining.as_secs().max(1)
            ))),
        }
    }

    /// Note a refusal of the credentials with fingerprint `sent` (those actually sent: the file may
    /// have changed since); warn once per streak of refusals.
    fn refused(&self, message: String, sent: u64) -> CallError {
        let (wait, first) = self.gate.lock().unwrap_or_else(|p| p.into_inner()).refused(Instant::now(), sent);
        let err = CallError::Auth(format!(
            "BIG-IP refused the login of user {:?} ({message}); check the username/password Secret and \
             login_provider. Next attempt in {}s, backing off up to 5 min, or at once when the password \
             changes",
            self.key.username,
            wait.as_secs().max(1)
        ));
        if first {
            tracing::warn!(bigip = %self.base, user = %self.key.username, wait_s = wait.as_secs(), "{}", err.summary());
        }
        err
    }

    /// `/mgmt/tm/cm/failover-status`: `ACTIVE`, `STANDBY`, `OFFLINE`, `FORCED OFFLINE`, ...
    pub async fn failover_status(&self, policy: RetryPolicy) -> Result<String, CallError> {
        let v: Value = self.call(&Request::get("/mgmt/tm/cm/failover-status"), policy).await?;
        wire::failover_status(&v).ok_or_else(|| {
            CallError::Decode("failover-status answer has no entries.*.nestedStats status".into())
        })
    }

    async fn extend(&self, token: &str, timeout: Duration) -> Result<(), CallError> {
        let path = format!("/mgmt/shared/authz/tokens/{token}");
        let body = serde_json::json!(wire::TokenTimeout { timeout: timeout.as_secs() });
        let req = Request::with_body(Method::PATCH, &path, body);
        self.send(&req, Some(&Auth::Token(token.to_string()))).await.map(|_| ())
    }

    /// Best effort: a failure only means the token lives until it expires.
    async fn delete_token(&self, token: &str) {
        let path = format!("/mgmt/shared/authz/tokens/{token}");
        let req = Request { method: Method::DELETE, path: &path, body: None, coordination: None };
        match self.send(&req, Some(&Auth::Token(token.to_string()))).await {
            Ok(_) => tracing::debug!(bigip = %self.base, "deleted BIG-IP token"),
            Err(e) => {
                tracing::debug!(bigip = %self.base, error = %hide(&e, token), "could not delete BIG-IP token")
            }
        }
    }

    /// One sink is done with the session. The last one out deletes the token.
    pub async fn release(self: Arc<Self>) {
        if self.holders.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        let token = self.token.lock().await.take();
        if let Some(t) = token {
            if Instant::now() < t.expires() {
                self.delete_token(&t.value).await;
            }
        }
    }

    /// Give up a holder's share without deleting anything (no runtime to do it with).
    pub fn forget_holder(&self) {
        self.holders.fetch_sub(1, Ordering::SeqCst);
    }
}

enum Auth {
    /// The header, and the fingerprint of the credentials in it (what a refusal is recorded against).
    Basic(String, u64),
    Token(String),
}

fn decode<T: DeserializeOwned>(v: Value) -> Result<T, CallError> {
    serde_json::from_value(v).map_err(|e| CallError::Decode(format!("unexpected answer shape: {e}")))
}

/// A fingerprint of the credentials, to notice a rotated password without keeping it around twice.
fn fingerprint(user: &str, password: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (user, password).hash(&mut h);
    h.finish()
}

/// Login failures get advice; the password never appears.
fn login_error(e: CallError, user: &str) -> CallError {
    match e {
        CallError::Http { status: 400, message } if message.contains("maximum active login tokens") => {
            CallError::Auth(format!(
                "user {user:?} holds too many live tokens ({message}); delete stale ones \
                 (DELETE /mgmt/shared/authz/tokens/TOKEN) or wait for them to expire. This controller \
                 reuses one token per BIG-IP and deletes it on shutdown"
            ))
        }
        other => other,
    }
}

/// `code`/`message` from BIG-IP's JSON error body, or the start of whatever else came (503 pages
/// while restarting are HTML).
fn error_message(status: StatusCode, body: &[u8]) -> String {
    if let Ok(e) = serde_json::from_slice::<wire::ErrorBody>(body) {
        if let Some(m) = e.message {
            return match e.code {
                Some(c) if c != status.as_u16() => format!("{m} (code {c})"),
                _ => m,
            };
        }
    }
    let text = String::from_utf8_lossy(body);
    let text: String = text.split_whitespace().collect::<Vec<_>>().join(" ").chars().take(200).collect();
    if text.is_empty() {
        status.canonical_reason().unwrap_or("no body").to_string()
    } else {
        text
    }
}

/// An error about a token, with the token itself blanked out (BIG-IP may echo it in messages).
fn hide(e: &CallError, token: &str) -> String {
    format!("{e:?}").replace(token, "<token>")
}

/// Token values are credentials: keep them out of logs.
fn redact(path: &str) -> String {
    match path.strip_prefix("/mgmt/shared/authz/tokens/") {
        Some(_) => "/mgmt/shared/authz/tokens/<token>".to_string(),
        None => path.to_string(),
    }
}

fn describe_reqwest(e: reqwest::Error) -> String {
    // Drop the URL: token paths carry the token, and the caller names the BIG-IP anyway.
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "request failed"
    };
    let e = e.without_url();
    let mut detail = format!("{kind}: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        detail.push_str(&format!(": {s}"));
        source = s.source();
    }
    if detail.contains("certificate") {
        detail.push_str(
            " (give the CA that signed the BIG-IP management certificate as ca_file; the certificate must \
             name the host in url; a self-signed BIG-IP certificate is given as pinned_cert instead)",
        );
    }
    detail
}

fn build_client(cfg: &F5Config, url: &str) -> Result<reqwest::Client, SinkError> {
    let b = match &cfg.pinned_cert {
        Some(pem) => crate::tls::pinned_builder(cfg.timeout, pem),
        None => crate::tls::client_builder(cfg.timeout, cfg.ca_file.as_deref(), cfg.insecure_skip_verify),
    };
    let b = b.map_err(|e| SinkError::Config(format!("f5 TLS: {e}")))?;
    if cfg.insecure_skip_verify {
        tracing::warn!(
            bigip = %url,
            "TLS verification of the BIG-IP is OFF (insecure_skip_verify): anyone on the path can read the \
             credentials. Give ca_file with the BIG-IP's CA, or pinned_cert with its own certificate"
        );
    }
    if url.starts_with("http://") {
        tracing::warn!(bigip = %url, "BIG-IP URL is plain http: credentials travel unencrypted");
    }
    b.build().map_err(|e| SinkError::Config(format!("f5: cannot build the HTTP client: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_of_both_families() {
        let tm = br#"{"code":404,"message":"01020036:3: The requested Pool (/Common/x) was not found.","errorStack":[],"apiError":3}"#;
        assert_eq!(
            error_message(StatusCode::NOT_FOUND, tm),
            "01020036:3: The requested Pool (/Common/x) was not found."
        );
        let rest = br#"{"code":401,"message":"X-F5-Auth-Token does not exist.","referer":"10.0.0.1","restOperationId":7,"kind":":resterrorresponse"}"#;
        assert_eq!(error_message(StatusCode::UNAUTHORIZED, rest), "X-F5-Auth-Token does not exist.");
        let html = b"<html>\n<body>Configuration Utility restarting...</body></html>";
        assert!(error_message(StatusCode::SERVICE_UNAVAILABLE, html).contains("restarting"));
        assert_eq!(error_message(StatusCode::BAD_GATEWAY, b""), "Bad Gateway");
    }

    #[test]
    fn retry_classes() {
        assert!(CallError::Http { status: 503, message: String::new() }.retryable());
        assert!(CallError::Http { status: 500, message: String::new() }.retryable());
        assert!(!CallError::Http { status: 400, message: String::new() }.retryable());
        assert!(!CallError::Http { status: 404, message: String::new() }.retryable());
        assert!(CallError::Transport("timed out".into()).retryable());
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let p = RetryPolicy { retries: 5, backoff: Duration::from_millis(100) };
        for attempt in 0..20 {
            let d = p.delay(attempt);
            let full =
                Duration::from_millis(100).saturating_mul(1 << attempt.min(16)).min(Duration::from_secs(5));
            assert!(d >= full / 2 && d <= full, "attempt {attempt}: {d:?}");
        }
    }

    #[test]
    fn token_paths_are_redacted() {
        assert_eq!(redact("/mgmt/shared/authz/tokens/ABCDEF"), "/mgmt/shared/authz/tokens/<token>");
        assert_eq!(redact("/mgmt/tm/ltm/pool"), "/mgmt/tm/ltm/pool");
    }
}
