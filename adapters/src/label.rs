//! Label sets for the controller's and the proxy's `/metrics`, with values escaped as the text
//! format requires. Here, beside [`crate::name`], because both binaries print names from outside.
//!
//! prometheus-client 0.23 writes label values into the text exposition as given: a `"`, `\` or
//! line break in one (a member name from someone's Prometheus labels, a model name from a request)
//! ends the value early and lets the rest of it forge samples. [`LabelValue`] escapes the three as
//! OpenMetrics and the Prometheus text format both define (`\"`, `\\`, `\n`) while it is encoded, so
//! every family built on [`Labels`] stays parseable whatever its values hold. Only the text encoder
//! is used here; a protobuf encoder would need the raw value.

use std::fmt::Write as _;

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};

/// A label value, escaped when it is written out; equality and hashing are the raw text's.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelValue(String);

impl LabelValue {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl EncodeLabelValue for LabelValue {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        let v = self.0.as_str();
        let mut rest = v;
        while let Some(i) = rest.find(['\\', '"', '\n']) {
            encoder.write_str(&rest[..i])?;
            encoder.write_str(match rest.as_bytes()[i] {
                b'\\' => "\\\\",
                b'"' => "\\\"",
                _ => "\\n",
            })?;
            rest = &rest[i + 1..];
        }
        encoder.write_str(rest)
    }
}

/// A series' labels: names are ours (constants), values may come from outside.
pub type Labels = Vec<(String, LabelValue)>;

pub fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), LabelValue(v.to_string()))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::registry::Registry;

    #[test]
    fn quotes_backslashes_and_line_breaks_stay_inside_the_value() {
        let mut r = Registry::default();
        let f = Family::<Labels, Counter>::default();
        r.register("t", "test", f.clone());
        f.get_or_create(&labels(&[("member", "a\"} 1\nllmlc_forged_series{x=\"\\")])).inc();
        let mut out = String::new();
        encode(&mut out, &r).expect("encodes");
        assert!(out.contains(r#"t_total{member="a\"} 1\nllmlc_forged_series{x=\"\\"} 1"#), "{out}");
        assert_eq!(out.lines().filter(|l| l.contains("forged")).count(), 1, "one line: {out}");
        assert!(!out.lines().any(|l| l.starts_with("llmlc_forged_series")), "{out}");
    }
}
