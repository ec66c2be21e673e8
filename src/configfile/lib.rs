//! Reading YAML config files so that every error names the file, the line and the field.
//!
//! Shared by the controller's config and the reference proxy's routing table: deserialization is
//! strict (unknown fields are errors) and the first error carries the line and column the YAML parser
//! knows plus the field path (`pools[1].ratio.min`); semantic problems found later are reported the
//! same way through [`problems_in`].

#![forbid(unsafe_code)]

use std::fmt;
use std::path::{Path, PathBuf};

/// One problem with a config file: where it is and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// Line and column, 1-based, where the YAML parser can tell.
    pub location: Option<(usize, usize)>,
    /// Field path such as `pools[1].ratio.min`; empty for whole-file problems.
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some((line, col)) = self.location {
            write!(f, ":{line}:{col}")?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// All problems found in one file.
#[derive(Debug, Clone)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Deserialize a YAML document strictly, turning the first error into a [`ConfigError`] with the
/// line and column the YAML parser knows and the field path. Shared by every config file we read.
pub fn deserialize_yaml<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T, ConfigErrors> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        let location = inner.location().map(|l| (l.line(), l.column()));
        // The YAML crate decorates its message with the position and (part of) the field path; we
        // print both ourselves, so keep just the description.
        let mut message = inner.to_string();
        if let Some(idx) = message.find(" at line ") {
            message.truncate(idx);
        }
        let field = if field == "." { String::new() } else { field };
        // serde_path_to_error writes `?` for a map key that is not a plain scalar (`? [a]` in
        // YAML): say what it is rather than print a question mark as if it were a field.
        let (field, mut message) = match field.strip_suffix(".?").or_else(|| (field == "?").then_some("")) {
            Some(parent) => (parent.to_string(), format!("a key that is not a plain name: {message}")),
            None => (field.replace(".?.", ".<key that is not a plain name>."), message),
        };
        if let Some((head, rest)) = message.split_once(": ") {
            if !head.is_empty() && field.starts_with(head) {
                message = rest.to_string();
            }
        }
        ConfigErrors(vec![ConfigError { file: path.to_path_buf(), location, field, message }])
    })
}

/// `(field, message)` problems as errors of the file at `path`.
pub fn problems_in(path: &Path, problems: Vec<(String, String)>) -> ConfigErrors {
    ConfigErrors(
        problems
            .into_iter()
            .map(|(field, message)| ConfigError { file: path.to_path_buf(), location: None, field, message })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Pool {
        name: String,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Doc {
        pools: Vec<Pool>,
    }

    #[test]
    fn a_key_that_is_not_a_name_is_named_as_such_not_as_a_question_mark() {
        let text = "pools:\n  - name: a\n    ? [x]\n    : 1\n";
        let e = deserialize_yaml::<Doc>(Path::new("c.yaml"), text).expect_err("refused");
        let shown = e.to_string();
        assert!(!shown.contains(".?"), "{shown}");
        assert!(shown.contains("pools[0]: a key that is not a plain name"), "{shown}");
    }
}
