//! The manual cannot rot: every YAML snippet of the controller's config in docs/ and the README is
//! extracted and run through `check --offline`, and every relative link points at a file (and a
//! heading) that exists.
//!
//! A snippet with a top-level `pools:` is a whole config and is checked as it is. Any other of our
//! snippets is a part of one pool (`members:`, `sink:`, `priority:` ... at any indentation): it is
//! dedented and placed in a minimal pool, so its fields are checked by the same parser with the
//! same file/line/field errors. Snippets of other programs' configs (Envoy bootstraps, Kubernetes
//! objects) only have to parse as YAML.

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

fn pages() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("md"))
        .collect();
    out.sort();
    out.push(root.join("README.md"));
    out
}

/// `(first line number, text)` of each fenced block tagged `yaml`.
fn yaml_blocks(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        match (&mut open, line.trim_start().strip_prefix("```")) {
            (None, Some(tag)) if tag.trim() == "yaml" || tag.trim() == "yml" => {
                open = Some((i + 2, String::new()))
            }
            (None, Some(_)) => open = Some((0, String::new())),
            (Some(_), Some(_)) => {
                if let Some((at, body)) = open.take() {
                    if at > 0 {
                        out.push((at, body));
                    }
                }
            }
            (Some((_, body)), None) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// Remove the common indentation of the non-blank lines.
fn dedent(s: &str) -> String {
    let indent =
        s.lines().filter(|l| !l.trim().is_empty()).map(|l| l.len() - l.trim_start().len()).min().unwrap_or(0);
    s.lines().map(|l| l.get(indent..).unwrap_or("")).collect::<Vec<_>>().join("\n") + "\n"
}

enum Kind {
    Whole,
    PoolPart,
    Foreign,
}

fn kind(snippet: &str) -> Kind {
    let v: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&dedent(snippet)).unwrap_or(serde_yaml_ng::Value::Null);
    let has = |k: &str| v.get(k).is_some();
    if has("pools") {
        Kind::Whole
    } else if has("clusters") || has("static_resources") || has("apiVersion") || has("kind") && !has("sink") {
        Kind::Foreign
    } else {
        Kind::PoolPart
    }
}

/// A pool around a part of one; fields the part sets are not repeated.
fn wrap(part: &str) -> String {
    let part = dedent(part);
    let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&part).unwrap_or(serde_yaml_ng::Value::Null);
    let mut pool = String::from("  - name: snippet\n    source: s\n");
    if v.get("members").is_none() {
        pool.push_str("    members: { static: ['10.0.0.1:8000'] }\n");
    }
    for l in part.lines() {
        pool.push_str("    ");
        pool.push_str(l);
        pool.push('\n');
    }
    format!("sources:\n  s: {{ kind: prometheus, url: 'http://127.0.0.1:9090' }}\npools:\n{pool}")
}

#[test]
fn every_config_snippet_in_the_manual_passes_check_offline() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut checked = 0;
    let mut failures = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read page");
        for (line, snippet) in yaml_blocks(&text) {
            let name = format!("{}:{line}", page.file_name().and_then(|n| n.to_str()).unwrap_or("?"));
            let config = match kind(&snippet) {
                Kind::Foreign => {
                    if let Err(e) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(&snippet) {
                        failures.push(format!("{name}: not YAML: {e}"));
                    }
                    continue;
                }
                Kind::Whole => snippet.clone(),
                Kind::PoolPart => wrap(&snippet),
            };
            let path = dir.path().join(format!("snippet-{checked}.yaml"));
            std::fs::write(&path, &config).expect("write snippet");
            let out = Command::new(BIN)
                .args(["check", "--offline", "--config"])
                .arg(&path)
                .output()
                .expect("check");
            if !out.status.success() {
                failures.push(format!(
                    "{name}: check --offline failed:\n{}\n--- as checked ---\n{config}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(checked >= 7, "only {checked} snippets found: is the extraction broken?");
}

/// GitHub's anchor of a heading: lowercase, spaces to `-`, punctuation other than `-` and `_` gone.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_relative_link_in_the_manual_points_at_something() {
    let link = regex::Regex::new(r"\]\(([^)\s]+)\)").expect("regex");
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read page");
        let base = page.parent().expect("page dir");
        for cap in link.captures_iter(&text) {
            let target = &cap[1];
            if target.starts_with("http") {
                continue;
            }
            let (file, frag) = target.split_once('#').unwrap_or((target, ""));
            let path = if file.is_empty() { page.clone() } else { base.join(file) };
            if !path.exists() {
                broken.push(format!("{}: {target}: no such file", page.display()));
                continue;
            }
            if !frag.is_empty() {
                let body = std::fs::read_to_string(&path).unwrap_or_default();
                let found = body
                    .lines()
                    .filter_map(|l| l.strip_prefix('#'))
                    .any(|h| anchor(h.trim_start_matches('#')) == frag);
                if !found {
                    broken.push(format!("{}: {target}: no heading with that anchor", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}
