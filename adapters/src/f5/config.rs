//! What a user writes to point the F5 sink at a BIG-IP pool, and the checks that need no network.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::names::PoolPath;
use crate::SecretRef;

/// F5 BIG-IP sink settings (`sink: {kind: f5, ...}`).
///
/// ```yaml
/// sink:
///   kind: f5
///   url: https://bigip.example.com
///   pool: /Common/llm_pool
///   username: {file: /etc/bigip/username}   # or a plain string
///   password: {file: /etc/bigip/password}
///   ca_file: /etc/bigip/ca.crt
/// ```
///
/// Ratios handed to the sink are already in the range the user configured for the controller. They are
/// sent as they are (identity), clamped into BIG-IP's 1..=65535; a clamped value is reported in the
/// push's warnings. BIG-IP has no ratio 0: a member the controller wants drained gets ratio 1.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct F5Config {
    /// Base URL of the BIG-IP management interface, e.g. `https://bigip.example.com` (or with a port,
    /// `https://10.0.0.5:8443`). No path, no credentials in the URL.
    pub url: String,
    /// Pool with partition, e.g. `/Common/llm_pool`.
    pub pool: String,
    /// `token` (default): log in once, send `X-F5-Auth-Token`, works for local and remote (LDAP,
    /// RADIUS, TACACS+) users. `basic`: HTTP basic auth on every request, local users only.
    #[serde(default)]
    pub auth: AuthMode,
    /// The BIG-IP user: a plain string, or `{file: ...}` / `{env: ...}` like the password.
    pub username: Username,
    /// The user's password. Read again at every login, so a rotated Secret is picked up.
    pub password: SecretRef,
    /// `loginProviderName` sent when logging in; `tmos` covers local users and the system's
    /// configured remote authentication.
    #[serde(default = "default_login_provider")]
    pub login_provider: String,
    /// PEM file with the CA (or bundle of CAs) that signed the BIG-IP's management certificate.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Skip certificate verification entirely. Logged as a warning at startup; prefer `ca_file`.
    #[serde(default)]
    pub insecure_skip_verify: bool,
    /// Deadline for one HTTP request.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// How many times a request that failed in a way worth retrying (timeout, 500 "connection to
    /// mcpd has been lost", 503 while restarting) is tried again within one push.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// First backoff between retries; doubled each time, with jitter.
    #[serde(default = "default_backoff", with = "humantime_serde")]
    pub retry_backoff: Duration,
    /// Put several ratio changes of one push into one iControl transaction, so the pool never shows a
    /// half-applied set. On by default; a single change is always sent directly.
    #[serde(default = "default_true")]
    pub transactions: bool,
}

/// How the sink authenticates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    #[default]
    Token,
    Basic,
}

/// A user name, written inline or read from where the password comes from (a Kubernetes Secret of
/// type `kubernetes.io/basic-auth` mounts both `username` and `password` as files).
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged, expecting = "a user name, or {file: PATH} / {env: VAR} / {value: NAME}")]
pub enum Username {
    Plain(String),
    From(SecretRef),
}

impl fmt::Debug for Username {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Username::Plain(s) => write!(f, "{s:?}"),
            Username::From(r) => write!(f, "{r:?}"),
        }
    }
}

impl Username {
    pub fn resolve(&self) -> Result<String, String> {
        let name = match self {
            Username::Plain(s) => s.clone(),
            Username::From(r) => r.resolve()?,
        };
        if name.trim().is_empty() {
            return Err("the BIG-IP username is empty".into());
        }
        Ok(name)
    }
}

fn default_login_provider() -> String {
    "tmos".into()
}

fn default_timeout() -> Duration {
    Duration::from_secs(5)
}

fn default_retries() -> u32 {
    3
}

fn default_backoff() -> Duration {
    Duration::from_millis(200)
}

fn default_true() -> bool {
    true
}

impl F5Config {
    /// Problems visible without talking to the BIG-IP, as `(field, message)` pairs.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        let mut err = |field: &str, msg: String| errs.push((field.to_string(), msg));
        match reqwest::Url::parse(&self.url) {
            Ok(u) => {
                if u.scheme() != "https" && u.scheme() != "http" {
                    err("url", format!("scheme must be https (or http through a proxy), not {}", u.scheme()));
                }
                if !u.username().is_empty() || u.password().is_some() {
                    err("url", "must not carry credentials; use username and password".into());
                }
                if u.path() != "/" || u.query().is_some() || u.fragment().is_some() {
                    err("url", "give only scheme, host and port, e.g. https://bigip.example.com".into());
                }
            }
            Err(e) => err("url", format!("not a URL: {e}")),
        }
        if let Err(e) = PoolPath::parse(&self.pool) {
            err("pool", e);
        }
        if let Username::Plain(u) = &self.username {
            if u.trim().is_empty() {
                err("username", "must not be empty".into());
            }
        }
        if self.login_provider.trim().is_empty() {
            err("login_provider", "must not be empty (BIG-IP's own is `tmos`)".into());
        }
        if self.ca_file.is_some() && self.insecure_skip_verify {
            err(
                "insecure_skip_verify",
                "contradicts ca_file: verify with the CA, or skip verification".into(),
            );
        }
        if self.timeout.is_zero() {
            err("timeout", "must be > 0".into());
        }
        if self.retries > 10 {
            err("retries", "at most 10: a push must finish within a control cycle".into());
        }
        if self.retry_backoff > Duration::from_secs(10) {
            err("retry_backoff", "at most 10s".into());
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> F5Config {
        serde_json::from_str(yaml).unwrap_or_else(|e| panic!("{e}: {yaml}"))
    }

    #[test]
    fn defaults_and_username_forms() {
        let c = parse(
            r#"{"url":"https://b.example","pool":"/Common/p","username":"svc","password":{"env":"PW"}}"#,
        );
        assert_eq!(c.auth, AuthMode::Token);
        assert_eq!(c.login_provider, "tmos");
        assert!(c.transactions);
        assert_eq!(c.username, Username::Plain("svc".into()));
        assert!(c.validate().is_empty(), "{:?}", c.validate());
        let c = parse(
            r#"{"url":"https://b.example","pool":"/Common/p","auth":"basic",
                "username":{"file":"/etc/bigip/username"},"password":{"file":"/etc/bigip/password"}}"#,
        );
        assert_eq!(c.username, Username::From(SecretRef::File("/etc/bigip/username".into())));
        assert_eq!(c.auth, AuthMode::Basic);
    }

    #[test]
    fn validation_names_fields() {
        let c = parse(
            r#"{"url":"https://u:p@b.example/mgmt","pool":"llm_pool","username":"","password":{"value":"x"},
                "ca_file":"/ca.pem","insecure_skip_verify":true,"timeout":"0s"}"#,
        );
        let fields: Vec<String> = c.validate().into_iter().map(|(f, _)| f).collect();
        for f in ["url", "pool", "username", "insecure_skip_verify", "timeout"] {
            assert!(fields.iter().any(|x| x == f), "{f} missing from {fields:?}");
        }
    }

    #[test]
    fn parses_as_a_sink_config() {
        let c: crate::SinkConfig = serde_json::from_str(
            r#"{"kind":"f5","url":"https://b.example","pool":"/Common/p","username":{"env":"U"},
                "password":{"file":"/etc/bigip/password"},"timeout":"3s","retry_backoff":"100ms"}"#,
        )
        .unwrap();
        assert_eq!(c.kind(), "f5");
        assert!(c.validate().is_empty(), "{:?}", c.validate());
        let e = serde_json::from_str::<crate::SinkConfig>(
            r#"{"kind":"f5","url":"https://b","pool":"/Common/p","username":{"vault":"x"},"password":{"env":"P"}}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("{file: PATH}"), "{e}");
        let e = serde_json::from_str::<crate::SinkConfig>(
            r#"{"kind":"f5","url":"https://b","pool":"/Common/p","username":"u","password":{"env":"P"},"pasword":1}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("pasword"), "{e}");
    }

    #[test]
    fn debug_never_shows_inline_passwords() {
        let c =
            parse(r#"{"url":"https://b","pool":"/Common/p","username":"u","password":{"value":"s3cret"}}"#);
        assert!(!format!("{c:?}").contains("s3cret"));
    }
}
