//! Names from outside the process: what a member's name may be, and how any text from outside is
//! escaped before it is printed.
//!
//! A member's name comes from Prometheus labels, the load balancer's own pool, EndpointSlices, DNS
//! or a config file, and every one of those can be written by someone else. [`check`] is the one
//! grammar they all pass through before they become a [`MemberId`](crate::MemberId):
//!
//! - `host:port`, where host is an RFC 1123 DNS name, an IPv4 address or a bracketed IPv6 address,
//!   with an optional BIG-IP route domain (`10.0.0.1%2:8000`), and the port 1-65535;
//! - or a load balancer's own member name as HAProxy and BIG-IP define them: letters, digits and
//!   `- _ . : %`, with `/` for BIG-IP partition paths (`/Common/web1:8000`).
//!
//! Anything else is refused: control characters, quotes, spaces, backslashes, braces, `<>&`. None
//! of those can then reach a metrics label, a text line, an LB command or a log record, and the
//! escapers below are the second wall for text that did not pass through here (pool and model
//! names, label values, error messages).

use std::borrow::Cow;
use std::net::{Ipv4Addr, Ipv6Addr};

/// Longest name accepted: a full DNS name (253), brackets, a route domain and a port fit.
pub const MAX_LEN: usize = 280;

/// Why a name was refused. Carries no part of the name: the caller decides how to show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidName {
    #[error("the name is empty")]
    Empty,
    #[error("the name is longer than {MAX_LEN} characters")]
    TooLong,
    #[error("the name holds a character no member name may have (only letters, digits and - _ . : % / [ ])")]
    Character,
    #[error("the name is neither host:port (DNS name, IPv4 or [IPv6], port 1-65535) nor a load balancer member name")]
    Shape,
}

/// Whether `s` may name a member (see the module docs).
pub fn check(s: &str) -> Result<(), InvalidName> {
    if s.is_empty() {
        return Err(InvalidName::Empty);
    }
    if s.len() > MAX_LEN {
        return Err(InvalidName::TooLong);
    }
    if !s
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '%' | '/' | '[' | ']'))
    {
        return Err(InvalidName::Character);
    }
    if is_host_port(s) || is_lb_name(s) {
        Ok(())
    } else {
        Err(InvalidName::Shape)
    }
}

/// `host:port` with the host a DNS name, IPv4 or `[IPv6]`, each with an optional `%N` route domain.
pub fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    if !port.bytes().all(|b| b.is_ascii_digit()) || !matches!(port.parse::<u16>(), Ok(1..)) {
        return false;
    }
    if let Some(inner) = host.strip_prefix('[') {
        let Some(inner) = inner.strip_suffix(']') else {
            return false;
        };
        let (addr, _) = split_route_domain(inner);
        return addr.is_some_and(|a| a.parse::<Ipv6Addr>().is_ok());
    }
    let (Some(host), _) = split_route_domain(host) else {
        return false;
    };
    host.parse::<Ipv4Addr>().is_ok() || is_dns_name(host)
}

/// `addr%N` -> (`addr`, N); `None` for the address when the route domain is not a number.
fn split_route_domain(host: &str) -> (Option<&str>, Option<u16>) {
    match host.split_once('%') {
        None => (Some(host), None),
        Some((addr, rd)) if rd.bytes().all(|b| b.is_ascii_digit()) => match rd.parse() {
            Ok(n) => (Some(addr), Some(n)),
            Err(_) => (None, None),
        },
        Some(_) => (None, None),
    }
}

/// RFC 1123: dot-separated labels of 1-63 letters, digits and inner hyphens, 253 at most in all;
/// an all-digit last label would be a mistyped IPv4 address, not a name.
fn is_dns_name(s: &str) -> bool {
    let s = s.strip_suffix('.').unwrap_or(s);
    if s.is_empty() || s.len() > 253 {
        return false;
    }
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    s.split('.').all(label_ok) && !s.rsplit('.').next().is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
}

/// A load balancer's own member name: HAProxy's server-name alphabet (letters, digits, `- _ . :`)
/// plus BIG-IP's `%` route domains and `/Partition/` paths. Brackets belong to IPv6 only, and `/`
/// to a full path from its start: `10.0.0.1:8000/x` would become a scrape URL's path.
fn is_lb_name(s: &str) -> bool {
    let first_ok = s.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == '/');
    let path_ok = !s.contains('/') || (s.starts_with('/') && !s.contains("//") && !s.ends_with('/'));
    first_ok && path_ok && !s.contains(['[', ']'])
}

/// `s` with everything outside the member-name alphabet written as a Rust-style escape (`\n`,
/// `\"`, `\u{1b}`, `\u{20}` for a space): one printable token, whatever `s` holds. For messages
/// and logs that show a refused name.
pub fn escape_name(s: &str) -> Cow<'_, str> {
    let plain =
        |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '%' | '/' | '[' | ']');
    if s.chars().all(plain) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            c if plain(c) => out.push(c),
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
        }
    }
    Cow::Owned(out)
}

/// `s` with control characters (line breaks, escapes, C1 codes) escaped and everything else kept:
/// text from outside that may be shown, but on one line and without terminal control.
pub fn escape_controls(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Longest stretch of outside text shown in a log record or an answer by [`shorten`]: a valid
/// member name is never cut.
pub const SHOWN_LEN: usize = MAX_LEN;

/// Outside text to show in a log record or an answer: its first [`SHOWN_LEN`] characters, escaped
/// like [`escape_name`], with the length of the whole said after a cut. A megabyte-long name
/// costs a few hundred bytes of log, not a megabyte, and still reads as itself.
pub fn shorten(s: &str) -> Cow<'_, str> {
    cut(s, escape_name)
}

/// As [`shorten`] for free text (a message, a type URL): control characters escaped like
/// [`escape_controls`], the rest kept.
pub fn shorten_text(s: &str) -> Cow<'_, str> {
    cut(s, escape_controls)
}

fn cut(s: &str, escape: fn(&str) -> Cow<'_, str>) -> Cow<'_, str> {
    // Cut before escaping: the work is bounded by the cut, not by what was sent.
    match s.char_indices().nth(SHOWN_LEN) {
        None => escape(s),
        Some((at, _)) => Cow::Owned(format!("{}...({} bytes in all)", escape(&s[..at]), s.len())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortened_text_is_bounded_and_says_how_long_it_was() {
        assert_eq!(shorten("10.0.0.1:80"), "10.0.0.1:80");
        let long = "a".repeat(1 << 20);
        let shown = shorten(&long);
        assert!(shown.len() < 2 * SHOWN_LEN, "{}", shown.len());
        assert!(shown.ends_with("...(1048576 bytes in all)"), "{shown}");
        assert_eq!(shorten("x\ny"), "x\\ny", "escaped like escape_name");
    }

    #[test]
    fn host_ports_and_lb_names_pass() {
        for ok in [
            "10.0.0.1:8000",
            "10.0.0.1%2:8000",
            "[2001:db8::1]:8000",
            "[::1%3]:80",
            "vllm-0.vllm.llm-serving.svc.cluster.local:8000",
            "vllm-0.vllm.svc.:8000",
            "localhost:1",
            "web_1:80",
            "srv1",
            "/Common/web1:8000",
            "/Common/10.0.0.1%2:80",
        ] {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn injections_and_broken_shapes_are_refused() {
        for (bad, why) in [
            ("", InvalidName::Empty),
            ("a b:80", InvalidName::Character),
            ("h:80\nllmlc_forged_series 1", InvalidName::Character),
            ("h\":80", InvalidName::Character),
            ("h\\:80", InvalidName::Character),
            ("h{a}:80", InvalidName::Character),
            ("<img src=x onerror=alert(1)>:80", InvalidName::Character),
            ("h:80\r", InvalidName::Character),
            ("h\u{1b}[31m:80", InvalidName::Character),
            ("é:80", InvalidName::Character),
            ("[::1:80", InvalidName::Shape),
            ("[not-v6]:80", InvalidName::Shape),
            ("-web:80", InvalidName::Shape),
            ("/a//b", InvalidName::Shape),
            ("10.0.0.1:8000/x", InvalidName::Shape),
            ("/Common/", InvalidName::Shape),
        ] {
            assert_eq!(check(bad), Err(why), "{bad:?}");
        }
        assert_eq!(check(&"a".repeat(MAX_LEN + 1)), Err(InvalidName::TooLong));
    }

    #[test]
    fn host_port_is_strict_about_hosts_and_ports() {
        assert!(is_host_port("a.b:65535"));
        for bad in [
            "a.b:0",
            "a.b:65536",
            "a.b:+80",
            "a..b:80",
            "a-.b:80",
            "10.0.0.300:80",
            "1.2.3:80",
            ":80",
            "[1.2.3.4]:80",
        ] {
            assert!(!is_host_port(bad), "{bad}");
        }
    }

    #[test]
    fn escaped_names_are_one_printable_token() {
        assert_eq!(escape_name("10.0.0.1:80"), "10.0.0.1:80");
        let e = escape_name("a b\n\"x\"\\<\u{7}");
        assert_eq!(e, "a\\u{20}b\\n\\\"x\\\"\\\\\\u{3c}\\u{7}");
        assert!(e.chars().all(|c| c.is_ascii_graphic()));
        assert_eq!(escape_controls("model \"x\"\nforged"), "model \"x\"\\nforged");
        assert_eq!(escape_controls("plain"), "plain");
    }
}
