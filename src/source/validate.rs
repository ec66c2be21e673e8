//! Checks of source-related configuration that `check` and `run` share, and [`redact_url`] for
//! printing URLs that may carry credentials.
//!
//! Each check mirrors what building the source would refuse at run time (header syntax, a CA file
//! that exists and holds certificates) or what would make the controller misbehave quietly (a
//! selector that is not a label-matcher list is pasted into PromQL; `interval: 1ns`; a member written
//! as a URL). They return a message; `config.rs` attaches the field path.

use std::path::Path;
use std::time::Duration;

use llm_lc_adapters::MemberId;

/// `url` with any user name and password replaced by `***`, and query parameters that look like
/// secrets (token, password, key, ...) masked. Unparseable input is masked whole after the scheme
/// separator when it contains `@`, so nothing secret is printed by accident.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if !u.username().is_empty() {
                let _ = u.set_username("***");
            }
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            if u.query().is_some() {
                let pairs: Vec<(String, String)> = u
                    .query_pairs()
                    .map(|(k, v)| {
                        let secret = ["token", "password", "passwd", "secret", "key", "auth", "signature"]
                            .iter()
                            .any(|s| k.to_ascii_lowercase().contains(s));
                        (k.into_owned(), if secret { "***".to_string() } else { v.into_owned() })
                    })
                    .collect();
                u.query_pairs_mut().clear().extend_pairs(pairs);
            }
            u.to_string()
        }
        Err(_) if url.contains('@') => match url.split_once("://") {
            Some((scheme, _)) => format!("{scheme}://***"),
            None => "***".into(),
        },
        Err(_) => url.to_string(),
    }
}

/// `text` with the user-info part of every `scheme://user:password@host` in it replaced by `***`: for
/// printing structures (sink settings) whose URLs we do not print one by one.
pub fn redact_urls_in(text: &str) -> String {
    static RE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = RE.get_or_init(|| {
        regex::Regex::new(r#"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s\\"]+@"#)
            .unwrap_or_else(|e| panic!("constant regex: {e}"))
    });
    re.replace_all(text, "${1}***@").into_owned()
}

/// A pool `selector`: label matchers without braces, as PromQL writes them inside `{...}`:
/// `name op "value"` separated by commas, `op` one of `=`, `!=`, `=~`, `!~`, values quoted with `"`,
/// `'` or `` ` ``, regexes valid.
pub fn selector(s: &str) -> Result<(), String> {
    matchers(s).map_err(|e| {
        format!("{e}; expected label matchers such as namespace=\"llm\",model_name=~\"llama.*\"")
    })
}

/// A Prometheus label name written plainly: `[a-zA-Z_][a-zA-Z0-9_]*`.
pub fn label_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// What is wrong with a regex, on one line: the regex crate's message spans several lines with a
/// caret, and its last line says it.
pub fn regex_error(e: &regex::Error) -> String {
    e.to_string().lines().last().unwrap_or_default().trim().to_string()
}

/// A selector in braces, e.g. `{job="vllm"}` (the `prometheus_up` form).
pub fn braced_selector(s: &str) -> Result<(), String> {
    let inner = s
        .trim()
        .strip_prefix('{')
        .and_then(|r| r.strip_suffix('}'))
        .ok_or_else(|| "must be a label selector in braces, e.g. '{job=\"vllm\"}'".to_string())?;
    matchers(inner).map_err(|e| format!("{e}; expected a label selector such as '{{job=\"vllm\"}}'"))
}

fn matchers(s: &str) -> Result<(), String> {
    let b = s.as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let mut count = 0;
    loop {
        ws(&mut i);
        if i == b.len() {
            return if count == 0 && !s.trim().is_empty() { Err("no matcher".into()) } else { Ok(()) };
        }
        // Label name: identifier, or a quoted UTF-8 name (Prometheus 3).
        let name_start = i;
        if b[i] == b'"' {
            quoted(b, &mut i)?;
        } else {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            if !label_name(&s[name_start..i]) {
                return Err(format!("`{}` does not start with a label name", &s[name_start..]));
            }
        }
        let name = &s[name_start..i];
        ws(&mut i);
        let op = ["=~", "!~", "!=", "="].into_iter().find(|op| s[i..].starts_with(op));
        let Some(op) = op else {
            return Err(format!("label {name} needs =, !=, =~ or !~"));
        };
        i += op.len();
        ws(&mut i);
        let value = quoted(b, &mut i).map_err(|e| format!("value of {name}: {e}"))?;
        if op.ends_with('~') {
            regex::Regex::new(&format!("^(?:{value})$"))
                .map_err(|e| format!("regex of {name}: {}", regex_error(&e)))?;
        }
        count += 1;
        ws(&mut i);
        match b.get(i) {
            None => return Ok(()),
            Some(b',') => i += 1,
            Some(_) => return Err(format!("unexpected `{}` after the matcher of {name}", &s[i..])),
        }
    }
}

/// A PromQL string literal at `b[*i]`, unescaped.
fn quoted(b: &[u8], i: &mut usize) -> Result<String, String> {
    let q = match b.get(*i) {
        Some(q @ (b'"' | b'\'' | b'`')) => *q,
        _ => return Err("expected a quoted string".into()),
    };
    *i += 1;
    let mut out = Vec::new();
    while let Some(&c) = b.get(*i) {
        *i += 1;
        if c == q {
            return String::from_utf8(out).map_err(|_| "not UTF-8".to_string());
        }
        if c == b'\\' && q != b'`' {
            let Some(&e) = b.get(*i) else { break };
            *i += 1;
            out.push(match e {
                b'n' => b'\n',
                b't' => b'\t',
                other => other,
            });
        } else if c == b'\n' && q != b'`' {
            return Err("newline inside a quoted string".into());
        } else {
            out.push(c);
        }
    }
    Err("unterminated quoted string".into())
}

/// An HTTP header the source sends: a valid token name, a value without line breaks or control
/// characters (what the HTTP client refuses at start).
pub fn header(name: &str, value: &str) -> Result<(), String> {
    reqwest::header::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("header name {name:?} is not a valid HTTP header name"))?;
    reqwest::header::HeaderValue::from_str(value).map_err(|_| {
        format!("value of header {name} contains a line break or other character not allowed in HTTP headers")
    })?;
    Ok(())
}

/// A CA bundle: the file exists, is readable and holds at least one PEM certificate.
pub fn ca_file(path: &Path) -> Result<(), String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| format!("{} is not a PEM bundle: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", path.display()));
    }
    Ok(())
}

/// `d` within `[min, max]`, with a message naming both in human units.
pub fn duration_within(d: Duration, min: Duration, max: Duration) -> Result<(), String> {
    if d < min || d > max {
        return Err(format!(
            "{} is outside {}..={}",
            humantime::format_duration(d),
            humantime::format_duration(min),
            humantime::format_duration(max)
        ));
    }
    Ok(())
}

/// A static member: `host:port` or `[v6]:port`, no scheme, no credentials, no path, port 1-65535.
pub fn member(m: &MemberId) -> Result<(), String> {
    let s = m.as_str();
    if s.contains("://") {
        return Err(format!(
            "\"{}\" is a URL; write host:port (the scheme is the source's `scheme`)",
            llm_lc_adapters::name::escape_name(&redact_url(s))
        ));
    }
    if s.contains('@') {
        return Err(
            "a member must not carry credentials; write host:port (tokens go in `bearer_token`)".into()
        );
    }
    if s.contains('/') || s.contains('?') || s.contains('#') {
        return Err(format!(
            "\"{}\" has a path; write host:port (the path is the source's `path`)",
            llm_lc_adapters::name::escape_name(s)
        ));
    }
    if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{s:?} contains whitespace"));
    }
    // The grammar every name from outside passes (quotes, braces, backslashes, HTML refused).
    if let Err(why) = llm_lc_adapters::name::check(s) {
        return Err(format!("\"{}\": {why}", llm_lc_adapters::name::escape_name(s)));
    }
    let Some((host, port)) = m.host_port() else {
        return Err(format!("\"{s}\" is not host:port"));
    };
    if host.is_empty() || port == 0 {
        return Err(format!("\"{s}\" is not host:port with a port 1-65535"));
    }
    if host.contains(':') && !s.starts_with('[') {
        return Err(format!("\"{s}\": write an IPv6 member as [address]:port"));
    }
    if !llm_lc_adapters::name::is_host_port(s) {
        return Err(format!(
            "\"{s}\": {host:?} is not an RFC 1123 host name, an IPv4 address or a bracketed IPv6 address"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_member_is_named_escaped_whatever_it_is_refused_for() {
        for raw in ["a/\u{1b}[2J\nforged:1", "http://h\r\nforged:1/x", "h\u{7}:1", "\"h\":1"] {
            let err = member(&MemberId::from(raw)).expect_err(raw);
            assert!(!err.chars().any(char::is_control), "{raw:?} -> {err:?}");
        }
    }

    #[test]
    fn credentials_and_secret_parameters_are_redacted() {
        assert_eq!(
            redact_url("https://user:pw@thanos:9091/x?namespace=llm"),
            "https://***:***@thanos:9091/x?namespace=llm"
        );
        assert_eq!(redact_url("http://p:9090/?token=abc&a=b"), "http://p:9090/?token=***&a=b");
        assert_eq!(redact_url("http://p:9090"), "http://p:9090/");
        assert_eq!(redact_url("not a url with user:pw@host"), "***");
        assert_eq!(
            redact_urls_in("Webhook { url: \"https://u:p@hook/x\", other: \"http://h/\" }"),
            "Webhook { url: \"https://***@hook/x\", other: \"http://h/\" }"
        );
    }

    #[test]
    fn selectors_must_be_matcher_lists() {
        for ok in [
            "",
            "job=\"vllm\"",
            " namespace = \"llm\" , model_name=~\"llama.*\", x!=\"\",y!~'a|b', ",
            "\"utf8.label\"=\"v\"",
            "a=`raw\\n`",
        ] {
            assert_eq!(selector(ok), Ok(()), "{ok:?}");
        }
        for bad in [
            "job=vllm",
            "job=\"vllm\"} or vector(1) or up{",
            "job=\"vllm\" job=\"x\"",
            "{job=\"vllm\"}",
            "job==\"x\"",
            "job=~\"(\"",
            "job=\"unterminated",
            "1abc=\"x\"",
        ] {
            assert!(selector(bad).is_err(), "{bad:?} must be refused");
        }
        assert_eq!(braced_selector("{job=\"vllm\"}"), Ok(()));
        assert!(braced_selector("{job=\"vllm\"} or up").is_err());
    }

    #[test]
    fn members_are_host_port_only() {
        for ok in ["10.0.0.1:8000", "vllm-0.vllm.llm.svc:8000", "[::1]:8000"] {
            assert_eq!(member(&MemberId::from(ok)), Ok(()), "{ok}");
        }
        for bad in [
            "http://10.0.0.1:8000",
            "user:pw@10.0.0.1:8000",
            "10.0.0.1:8000/metrics",
            "10.0.0.1",
            "h:0",
            "a b:1",
            "h\":80",
            "<b>:80",
            "h{x}:80",
        ] {
            assert!(member(&MemberId::from(bad)).is_err(), "{bad}");
        }
        assert!(!member(&MemberId::from("http://u:secret@h:1")).unwrap_err().contains("secret"));
    }

    #[test]
    fn headers_refuse_line_breaks() {
        assert_eq!(header("X-Scope-OrgID", "team-a"), Ok(()));
        assert!(header("X Bad", "v").is_err());
        assert!(header("X-A", "a\r\nInjected: yes").is_err());
    }
}
