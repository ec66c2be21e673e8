//! What `check --offline` could not verify: every file, secret and address a config names.
//!
//! Offline, `check` reads nothing but the config itself: no CA bundle, no Secret, no network. What
//! it took on trust is listed from the document as written, so the list cannot miss a field a new
//! sink adds: any `ca_file`, any `{ file: ... }` or `{ env: ... }` secret, and any URL or address
//! (`url`, `api_url`, `address`, `addresses`, `runtime`, or a string with `://`).

use serde_yaml_ng::Value;

/// `(field path, what was not verified)`, in document order.
pub fn unverified(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Ok(doc) = serde_yaml_ng::from_str::<Value>(text) {
        walk(&doc, String::new(), &mut out);
    }
    out
}

fn walk(v: &Value, at: String, out: &mut Vec<(String, String)>) {
    match v {
        Value::Mapping(m) => {
            for (k, child) in m {
                let Some(key) = k.as_str() else { continue };
                let path = if at.is_empty() { key.to_string() } else { format!("{at}.{key}") };
                match (key, child) {
                    ("ca_file", Value::String(f)) => out.push((path, format!("CA bundle {f} (not read)"))),
                    ("file", Value::String(f)) => out.push((path, format!("secret file {f} (not read)"))),
                    ("env", Value::String(e)) => out.push((path, format!("secret from ${e} (not read)"))),
                    ("url" | "api_url" | "address" | "runtime", Value::String(a)) => {
                        out.push((path, format!("{a} (not reached)")))
                    }
                    _ => walk(child, path, out),
                }
            }
        }
        Value::Sequence(s) => {
            for (i, child) in s.iter().enumerate() {
                walk(child, format!("{at}[{i}]"), out);
            }
        }
        Value::String(s) if s.contains("://") => out.push((at, format!("{s} (not reached)"))),
        Value::Tagged(t) => walk(&t.value, at, out),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_secrets_and_addresses_are_listed_with_their_fields() {
        let text = "sources:\n  thanos:\n    kind: prometheus\n    url: https://thanos:9091\n    ca_file: /etc/ca.crt\n    bearer_token: { file: /var/run/token }\npools:\n  - name: p\n    sink:\n      kind: f5\n      address: https://bigip.example\n      password: { env: F5_PASSWORD }\n      addresses: ['https://a', 'https://b']\n    interval: 5s\n";
        let got = unverified(text);
        let fields: Vec<&str> = got.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(
            fields,
            [
                "sources.thanos.url",
                "sources.thanos.ca_file",
                "sources.thanos.bearer_token.file",
                "pools[0].sink.address",
                "pools[0].sink.password.env",
                "pools[0].sink.addresses[0]",
                "pools[0].sink.addresses[1]",
            ]
        );
        assert_eq!(got[1].1, "CA bundle /etc/ca.crt (not read)");
        assert_eq!(got[4].1, "secret from $F5_PASSWORD (not read)");
    }
}
