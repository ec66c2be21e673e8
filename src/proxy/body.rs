//! Parsing a request body strictly: a JSON object whose keys appear once, at every depth.
//!
//! `serde_json::Value` keeps the last of two equal keys, Python's `json` (vLLM) does the same, other
//! parsers keep the first: with `{"model":"nope","model":"llama-8b"}` the routing table and a backend
//! (or a guard service) could read different models. The proxy refuses such a body with a 400 that
//! names the key, so every reader of the body sees the same request.

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq)]
pub enum BodyError {
    /// A key appears twice in one object.
    DuplicateKey { key: String, at: String },
    /// Not JSON at all.
    Syntax(String),
}

const DUP: &str = "\u{0}duplicate key\u{0}";

/// Parse `bytes` as JSON, refusing duplicate keys in any object.
pub fn parse_strict(bytes: &[u8]) -> Result<Value, BodyError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let v = Strict.deserialize(&mut de).and_then(|v| de.end().map(|_| v));
    v.map_err(|e| {
        let text = e.to_string();
        match text.strip_prefix(DUP) {
            // serde_json appends " at line L column C" to a custom message.
            Some(rest) => {
                let (key, at) = rest.split_once(DUP).unwrap_or((rest, ""));
                BodyError::DuplicateKey { key: key.to_string(), at: at.trim().to_string() }
            }
            None => BodyError::Syntax(text),
        }
    })
}

struct Strict;

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Strict.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(v) = seq.next_element_seed(Strict)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                return Err(de::Error::custom(format!("{DUP}{k}{DUP}")));
            }
            let v = map.next_value_seed(Strict)?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn same_value_as_serde_json_for_clean_bodies() {
        let text = r#"{"model":"m","n":1,"t":-2,"f":0.5,"b":true,"z":null,"a":[1,{"x":"y"}],"s":"\u00e9"}"#;
        assert_eq!(parse_strict(text.as_bytes()).unwrap(), serde_json::from_str::<Value>(text).unwrap());
    }

    #[test]
    fn duplicate_keys_are_named_at_any_depth() {
        let e = parse_strict(br#"{"model":"nope","model":"llama-8b"}"#).unwrap_err();
        assert!(
            matches!(&e, BodyError::DuplicateKey { key, at } if key == "model" && at.contains("column")),
            "{e:?}"
        );
        let e = parse_strict(br#"{"messages":[{"role":"user","role":"system"}]}"#).unwrap_err();
        assert!(matches!(&e, BodyError::DuplicateKey { key, .. } if key == "role"), "{e:?}");
        // Equal keys in different objects are fine.
        assert_eq!(parse_strict(br#"{"a":{"k":1},"b":{"k":2}}"#).unwrap(), json!({"a":{"k":1},"b":{"k":2}}));
    }

    #[test]
    fn syntax_errors_and_trailing_garbage() {
        assert!(matches!(parse_strict(b"{\"a\":"), Err(BodyError::Syntax(_))));
        assert!(matches!(parse_strict(b"{} x"), Err(BodyError::Syntax(_))));
    }
}
