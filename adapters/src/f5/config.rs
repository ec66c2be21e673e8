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
/// sent as they are (identity), clamped into 1..=`max_ratio` (100 unless raised, at most BIG-IP's
/// 65535); a clamped value is reported in the push's warnings. BIG-IP has no ratio 0: a member the
/// controller wants drained gets ratio 1.
///
/// An HA pair gives every unit's management address as `urls: [...]`; the sink writes only to the
/// unit whose failover status is ACTIVE, and follows a failover.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct F5Config {
    /// Base URL of the BIG-IP management interface, e.g. `https://bigip.example.com` (or with a port,
    /// `https://10.0.0.5:8443`). No path, no credentials in the URL. For an HA pair use `urls`.
    #[serde(default)]
    pub url: String,
    /// The management URLs of every unit of an HA pair (or device group). The sink asks each unit's
    /// `/mgmt/tm/cm/failover-status` and writes only to the ACTIVE one.
    #[serde(default)]
    pub urls: Vec<String>,
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
    /// PEM file with the BIG-IP's own management certificate, trusted as exactly that certificate
    /// (pinned): for the self-signed certificate a BIG-IP makes for itself, which is often marked as a
    /// CA and names `localhost.localdomain`, so it cannot serve as `ca_file`. Any other certificate is
    /// refused; the host name is not checked (the pin is stronger). Renewing the certificate on the
    /// BIG-IP means updating this file.
    #[serde(default)]
    pub pinned_cert: Option<PathBuf>,
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
    /// Member PATCHes of one push in flight at once (queued into the transaction, or sent directly).
    /// A management plane answering in 150 ms then takes 5 round trips, not 40, for 40 members.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// The largest ratio written (default 100, F5's documented member ratio range for AS3 and
    /// Ansible). Raise it (up to 65535) only for a BIG-IP known to accept more; the pool's
    /// `ratio.max` must not exceed it.
    #[serde(default = "default_max_ratio")]
    pub max_ratio: u32,
    /// After a refused login, wait this long before logging in again, doubling with each refusal up
    /// to 5 minutes, so a wrong password does not lock the account (LDAP/AD lockout policies). A
    /// changed password (the Secret file rotated) ends the wait at once.
    #[serde(default = "default_login_backoff", with = "humantime_serde")]
    pub login_backoff: Duration,
    /// `push` (default): write member ratios. `sideband`: never write to the BIG-IP (for pools that
    /// CIS or AS3 own, whose reconcile would overwrite ratios); members are read from the pool and an
    /// iRule on the BIG-IP fetches the ratios from the controller (`deploy/bigip/irule/sideband.tcl`).
    #[serde(default)]
    pub mode: F5Mode,
    /// For pools with priority tiers: members of inactive tiers (ratio 0 from the controller) are
    /// moved to BIG-IP priority group 1, active ones to group 2. Needs the pool's priority group
    /// activation (`min-active-members` >= 1), which the sink checks on every push. Off by default:
    /// the sink then never touches `priorityGroup`, which an operator may use for other things.
    #[serde(default)]
    pub priority_groups: bool,
}

/// Whether the sink writes ratios to the BIG-IP, or the BIG-IP pulls them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum F5Mode {
    #[default]
    Push,
    Sideband,
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

fn default_concurrency() -> usize {
    8
}

fn default_max_ratio() -> u32 {
    super::plan::DEFAULT_MAX_RATIO
}

fn default_login_backoff() -> Duration {
    Duration::from_secs(15)
}

/// The longest wait between logins after refusals.
pub const MAX_LOGIN_BACKOFF: Duration = Duration::from_secs(300);

impl F5Config {
    /// A config with every optional setting at its default, for code that builds one by hand.
    pub fn new(url: &str, pool: &str, username: Username, password: SecretRef) -> F5Config {
        F5Config {
            url: url.to_string(),
            urls: Vec::new(),
            pool: pool.to_string(),
            auth: AuthMode::default(),
            username,
            password,
            login_provider: default_login_provider(),
            ca_file: None,
            pinned_cert: None,
            insecure_skip_verify: false,
            timeout: default_timeout(),
            retries: default_retries(),
            retry_backoff: default_backoff(),
            transactions: true,
            concurrency: default_concurrency(),
            max_ratio: default_max_ratio(),
            login_backoff: default_login_backoff(),
            mode: F5Mode::default(),
            priority_groups: false,
        }
    }

    /// The management URLs of the units, without trailing slashes: `urls`, or `url` alone.
    pub fn unit_urls(&self) -> Vec<String> {
        let all: Vec<&String> =
            if self.urls.is_empty() { vec![&self.url] } else { self.urls.iter().collect() };
        all.into_iter().map(|u| u.trim_end_matches('/').to_string()).collect()
    }

    /// Problems visible without talking to the BIG-IP, as `(field, message)` pairs.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        let mut err = |field: &str, msg: String| errs.push((field.to_string(), msg));
        match (self.url.is_empty(), self.urls.is_empty()) {
            (true, true) => err("url", "missing: give the management URL (or `urls` for an HA pair)".into()),
            (false, false) => err("urls", "give either url (one unit) or urls (an HA pair), not both".into()),
            _ => {}
        }
        let fields: Vec<(String, &String)> = if self.urls.is_empty() {
            vec![("url".to_string(), &self.url)]
        } else {
            self.urls.iter().enumerate().map(|(i, u)| (format!("urls[{i}]"), u)).collect()
        };
        for (field, url) in fields.into_iter().filter(|(_, u)| !u.is_empty()) {
            match reqwest::Url::parse(url) {
                Ok(u) => {
                    if u.scheme() != "https" && u.scheme() != "http" {
                        err(
                            &field,
                            format!("scheme must be https (or http through a proxy), not {}", u.scheme()),
                        );
                    }
                    if !u.username().is_empty() || u.password().is_some() {
                        err(&field, "must not carry credentials; use username and password".into());
                    }
                    if u.path() != "/" || u.query().is_some() || u.fragment().is_some() {
                        err(&field, "give only scheme, host and port, e.g. https://bigip.example.com".into());
                    }
                }
                Err(e) => err(&field, format!("not a URL: {e}")),
            }
        }
        let mut seen = self.unit_urls();
        seen.sort();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            err("urls", "lists the same unit twice".into());
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
        if self.pinned_cert.is_some() && (self.ca_file.is_some() || self.insecure_skip_verify) {
            err(
                "pinned_cert",
                "give one way to trust the BIG-IP: pinned_cert (its own self-signed certificate), ca_file \
                 (the CA that signed it), or insecure_skip_verify"
                    .into(),
            );
        }
        if self.concurrency == 0 || self.concurrency > 64 {
            err("concurrency", "must be 1..=64".into());
        }
        if !(1..=super::plan::WIRE_MAX).contains(&self.max_ratio) {
            err("max_ratio", format!("must be 1..={}, BIG-IP's largest member ratio", super::plan::WIRE_MAX));
        }
        if self.login_backoff < Duration::from_millis(100) || self.login_backoff > MAX_LOGIN_BACKOFF {
            err("login_backoff", "must be between 100ms and 5m".into());
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
        if self.priority_groups && self.mode == F5Mode::Sideband {
            err(
                "priority_groups",
                "needs mode push: in sideband mode the sink never writes to the BIG-IP".into(),
            );
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
