//! Shared vocabulary: who a member is, what a set of ratios is, and where secrets come from.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::MemberMap;

/// A model server as the load balancer knows it: `host:port` (IPv6 hosts in brackets, `[2001:db8::1]:8000`).
///
/// Kept as the string users write so that config, logs, metrics labels and LB lookups all agree.
/// Shared, not copied: a cycle hands the same id to the snapshot, the policy, the change filter and
/// the report, and cloning it is a reference count, not an allocation.
#[derive(Debug, Clone)]
pub struct MemberId(Arc<str>);

// Equality and order are the string's; the pointer check first is what makes sharing pay: a cycle
// compares the same ids (the pool's own list, the snapshot's, the policy's memory) over and over,
// and the same allocation is equal without reading a byte.
impl PartialEq for MemberId {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl Eq for MemberId {}

// The string's hash, consistent with equality (equal ids are equal strings).
impl std::hash::Hash for MemberId {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.hash(h);
    }
}

impl PartialOrd for MemberId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for MemberId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        if Arc::ptr_eq(&self.0, &other.0) {
            return std::cmp::Ordering::Equal;
        }
        self.0.cmp(&other.0)
    }
}

impl Serialize for MemberId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for MemberId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(MemberId::new)
    }
}

impl MemberId {
    /// An id from a name the process made or already checked (config that passed `check`, tests,
    /// addresses it formatted itself). Names from outside go through [`MemberId::parse`].
    pub fn new(s: impl Into<String>) -> Self {
        MemberId(Arc::from(s.into()))
    }

    /// The door for names from outside: `host:port` or a load balancer's own member name, and
    /// nothing that could break a line, a label or a command (see [`crate::name`]).
    pub fn parse(s: &str) -> Result<Self, crate::InvalidName> {
        crate::name::check(s)?;
        Ok(MemberId::from(s))
    }

    /// Whether the id passes [`MemberId::parse`]'s grammar.
    pub fn is_valid(&self) -> bool {
        crate::name::check(&self.0).is_ok()
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Host and port, when the id has the `host:port` shape. Brackets around IPv6 hosts are removed.
    pub fn host_port(&self) -> Option<(&str, u16)> {
        let (host, port) = self.0.rsplit_once(':')?;
        let port = port.parse().ok()?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.is_empty() {
            return None;
        }
        Some((host, port))
    }
}

// Shown escaped and bounded: a valid id is its own text, and an id that skipped the check (built
// with `new`, or read from outside) still prints as one token of at most a few hundred bytes in
// logs, tables and messages.
impl fmt::Display for MemberId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::name::shorten(&self.0))
    }
}

impl From<&str> for MemberId {
    fn from(s: &str) -> Self {
        MemberId(Arc::from(s))
    }
}

impl From<String> for MemberId {
    fn from(s: String) -> Self {
        MemberId::new(s)
    }
}

/// The largest ratio anything in the product accepts: BIG-IP's own upper bound for a pool member's
/// `ratio`, above every load balancer's useful range (HAProxy's weights stop at 256 and are scaled
/// to it). A pool's `ratio.max`, the proxy's ratio intake and its hash ring are bounded by it, so
/// no number from outside can size a structure.
pub const MAX_RATIO: u32 = 65_535;

/// One integer ratio per member of a pool, in member order, so output and pushes are deterministic.
/// Serialized as a map (`{"id": ratio}`).
///
/// Shared: a cycle hands the same ratios to its report, its memory and the push in flight, so a
/// copy is a reference count, not a map; changing a shared one copies it first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ratios(Arc<MemberMap<u32>>);

impl Serialize for Ratios {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Ratios {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        MemberMap::deserialize(d).map(Ratios::from)
    }
}

impl Ratios {
    pub fn get(&self, m: &MemberId) -> Option<u32> {
        self.0.get(m).copied()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Members and their ratios, in member order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&MemberId, u32)> + ExactSizeIterator + Clone {
        self.0.iter().map(|(k, v)| (k, *v))
    }

    /// Members, in order.
    pub fn members(&self) -> impl DoubleEndedIterator<Item = &MemberId> + ExactSizeIterator + Clone {
        self.0.keys()
    }

    /// Set one member's ratio (inserted in order when new).
    pub fn insert(&mut self, m: MemberId, ratio: u32) {
        Arc::make_mut(&mut self.0).insert(m, ratio);
    }

    /// The ratios as a member map (for merging with other member-ordered data).
    pub fn as_map(&self) -> &MemberMap<u32> {
        &self.0
    }

    /// True when pushing these would leave the pool with no member that can take new traffic.
    pub fn drains_everything(&self) -> bool {
        self.0.values().all(|&r| r == 0)
    }
}

impl From<MemberMap<u32>> for Ratios {
    fn from(m: MemberMap<u32>) -> Self {
        Ratios(Arc::new(m))
    }
}

impl FromIterator<(MemberId, u32)> for Ratios {
    fn from_iter<I: IntoIterator<Item = (MemberId, u32)>>(iter: I) -> Self {
        Ratios(Arc::new(iter.into_iter().collect()))
    }
}

/// Where a secret comes from. File and environment always work, so nothing sensitive has to sit in
/// the config file; `value` exists for local experiments.
///
/// Written as a one-key map: `{ file: /path }`, `{ env: NAME }` or `{ value: "..." }`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "SecretRefRepr")]
pub enum SecretRef {
    /// Read from a file at use time (a mounted Kubernetes Secret or service-account token); trailing
    /// whitespace is trimmed.
    File(std::path::PathBuf),
    /// Read from an environment variable.
    Env(String),
    /// Inline in the config. Convenient, but ends up in ConfigMaps and shell history.
    Value(String),
}

/// The map form users write; YAML crates would otherwise want `!file` tags for an enum.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretRefRepr {
    file: Option<std::path::PathBuf>,
    env: Option<String>,
    value: Option<String>,
}

impl TryFrom<SecretRefRepr> for SecretRef {
    type Error = &'static str;

    fn try_from(r: SecretRefRepr) -> Result<Self, Self::Error> {
        match (r.file, r.env, r.value) {
            (Some(f), None, None) => Ok(SecretRef::File(f)),
            (None, Some(e), None) => Ok(SecretRef::Env(e)),
            (None, None, Some(v)) => Ok(SecretRef::Value(v)),
            _ => Err("a secret is exactly one of `file: PATH`, `env: VARIABLE` or `value: TEXT`"),
        }
    }
}

impl fmt::Debug for SecretRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret itself, only where it comes from.
        match self {
            SecretRef::File(p) => write!(f, "file:{}", p.display()),
            SecretRef::Env(v) => write!(f, "env:{v}"),
            SecretRef::Value(_) => f.write_str("value:<redacted>"),
        }
    }
}

impl SecretRef {
    /// Resolve the secret now. Files are re-read on every call so that rotated tokens are picked up.
    pub fn resolve(&self) -> Result<String, String> {
        match self {
            SecretRef::File(p) => std::fs::read_to_string(p)
                .map(|s| s.trim_end().to_string())
                .map_err(|e| format!("cannot read secret file {}: {e}", p.display())),
            SecretRef::Env(v) => {
                std::env::var(v).map_err(|_| format!("environment variable {v} is not set (or is not UTF-8)"))
            }
            SecretRef::Value(s) => Ok(s.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_shapes() {
        assert_eq!(MemberId::from("10.0.0.1:8000").host_port(), Some(("10.0.0.1", 8000)));
        assert_eq!(MemberId::from("[2001:db8::1]:80").host_port(), Some(("2001:db8::1", 80)));
        assert_eq!(MemberId::from("vllm-0.svc:8000").host_port(), Some(("vllm-0.svc", 8000)));
        assert_eq!(MemberId::from("nohost").host_port(), None);
        assert_eq!(MemberId::from(":80").host_port(), None);
        assert_eq!(MemberId::from("h:notaport").host_port(), None);
    }

    #[test]
    fn drain_detection() {
        let r: Ratios = [(MemberId::from("a:1"), 0), (MemberId::from("b:1"), 0)].into_iter().collect();
        assert!(r.drains_everything());
        let r: Ratios = [(MemberId::from("a:1"), 0), (MemberId::from("b:1"), 3)].into_iter().collect();
        assert!(!r.drains_everything());
    }

    #[test]
    fn secret_forms_parse_from_maps() {
        let f: SecretRef = serde_json::from_str(r#"{"file": "/run/token"}"#).expect("file");
        assert_eq!(f, SecretRef::File("/run/token".into()));
        let e: SecretRef = serde_json::from_str(r#"{"env": "TOKEN"}"#).expect("env");
        assert_eq!(e, SecretRef::Env("TOKEN".into()));
        let both = serde_json::from_str::<SecretRef>(r#"{"env": "A", "value": "b"}"#).expect_err("two forms");
        assert!(both.to_string().contains("exactly one"), "{both}");
    }

    #[test]
    fn secret_debug_redacts_inline_values() {
        let s = SecretRef::Value("hunter2".into());
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
