//! Member ids -> IP socket addresses. Envoy's EDS accepts IP literals only (a name is refused with
//! "malformed IP address"), so members written as DNS names are resolved by the controller on every
//! push; a moved pod then shows up as a new version.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use crate::MemberId;

use super::assignment::Resolved;

/// Resolve every member. Members that cannot be resolved are returned separately with the reason,
/// so one bad name does not stop the others.
pub async fn resolve_all(
    members: &[MemberId],
    timeout: Duration,
) -> (Vec<Resolved>, Vec<(MemberId, String)>) {
    let mut ok = Vec::with_capacity(members.len());
    let mut failed = Vec::new();
    for m in members {
        match resolve(m, timeout).await {
            Ok(r) => ok.push(r),
            Err(e) => failed.push((m.clone(), e)),
        }
    }
    (ok, failed)
}

/// One member. IP literals need no lookup; names take the smallest IPv4 address they resolve to (or
/// the smallest IPv6 one when there is no IPv4), so the choice does not flap with DNS answer order.
pub async fn resolve(m: &MemberId, timeout: Duration) -> Result<Resolved, String> {
    let (host, port) = m.host_port().ok_or_else(|| format!("{m} is not host:port"))?;
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(Resolved { member: m.clone(), addr: SocketAddr::new(ip, port), hostname: None });
    }
    let addrs: Vec<SocketAddr> =
        match tokio::time::timeout(timeout, tokio::net::lookup_host((host, port))).await {
            Ok(Ok(it)) => it.collect(),
            Ok(Err(e)) => return Err(format!("cannot resolve {host}: {e}")),
            Err(_) => return Err(format!("resolving {host} took longer than {timeout:?}")),
        };
    let best = addrs.iter().filter(|a| a.is_ipv4()).min().or_else(|| addrs.iter().min());
    match best {
        Some(addr) => Ok(Resolved { member: m.clone(), addr: *addr, hostname: Some(host.to_string()) }),
        None => Err(format!("{host} resolves to no address")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn literals_and_names() {
        let t = Duration::from_secs(2);
        let r = resolve(&MemberId::from("10.0.0.1:8000"), t).await.unwrap();
        assert_eq!(r.addr, "10.0.0.1:8000".parse().unwrap());
        assert_eq!(r.hostname, None);
        let r = resolve(&MemberId::from("[::1]:80"), t).await.unwrap();
        assert_eq!(r.addr, "[::1]:80".parse().unwrap());
        let r = resolve(&MemberId::from("localhost:8000"), t).await.unwrap();
        assert!(r.addr.ip().is_loopback());
        assert_eq!(r.hostname.as_deref(), Some("localhost"));
        assert!(resolve(&MemberId::from("no-port"), t).await.is_err());
        let (ok, bad) =
            resolve_all(&[MemberId::from("127.0.0.1:1"), MemberId::from("nope.invalid:80")], t).await;
        assert_eq!(ok.len(), 1);
        assert_eq!(bad[0].0, MemberId::from("nope.invalid:80"));
    }
}
