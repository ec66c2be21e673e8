//! Export of the routing table as a BIG-IP data group, so one table drives both the proxy and the
//! generic iRule in `deploy/bigip/irule/llm_route.tcl`.
//!
//! Encoding (type `string` data group, one record per step):
//! - `__version` → `1`; `__start` → the first step's id.
//! - `STEP_ID` → `src=field&path=P&op=OP&value=V&match=T&miss=T[&match_split=S][&miss_split=S]`,
//!   or `src=header&name=H&...`.
//! - `V`: the value, percent-encoded; for `one-of` each element percent-encoded, joined by `,`.
//! - `T`: `step:ID`, `pool:BIGIP_POOL` or `reject:STATUS:MESSAGE` (message percent-encoded).
//! - `S`: `MODEL*PERCENT,...` with model names percent-encoded.
//!
//! Everything but `[A-Za-z0-9-_.~/]` is percent-encoded, so no record needs tmsh quoting tricks and
//! the iRule splits on `&`, `=`, `,`, `:` and `*` safely, then `URI::decode`s each piece.
//!
//! Guard steps cannot run in the iRule (it cannot ask the guard service or apply the deny rules):
//! they are exported as pass-through steps (`src=field&path=model&op=exists`, both branches to
//! the guard's `match` target), and the export says so on stderr, in the tmsh text and in the REST
//! body's `description`. Keeping them needs the proxy in front of (or behind) the BIG-IP, or a
//! BIG-IP-side equivalent: an iRule that collects the body and calls the guard service with
//! `HTTP::collect` + `sideband` (or an F5 AI guardrail product), which this project does not ship.

use serde_json::{json, Value};

use super::config::ProxyConfig;
use super::route::{Cond, RouteTable, Source, Target};

pub const FORMAT_VERSION: &str = "1";

/// Percent-encode everything outside `[A-Za-z0-9-_.~/]`.
pub fn pct(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A scalar as the iRule sees it: text of strings, JSON text of numbers/booleans/null.
fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The data group's records, in table order: `(name, data)`.
pub fn records(table: &RouteTable, cfg: &ProxyConfig) -> Vec<(String, String)> {
    let bigip_pool = |name: &str| -> String {
        cfg.pools
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| p.bigip_pool.clone())
            .unwrap_or_else(|| name.to_string())
    };
    let target = |t: &Target| -> String {
        match t {
            Target::Step(i) => format!("step:{}", pct(&table.steps[*i].id)),
            Target::Pool { pool, .. } => format!("pool:{}", pct(&bigip_pool(pool))),
            Target::Reject { status, message } => format!("reject:{status}:{}", pct(message)),
        }
    };
    let split = |t: &Target| -> Option<String> {
        match t {
            Target::Pool { split: Some(k), .. } => Some(
                table.splits[*k]
                    .models
                    .iter()
                    .map(|(m, p)| format!("{}*{p}", pct(m)))
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            _ => None,
        }
    };
    let mut out = vec![
        ("__version".to_string(), FORMAT_VERSION.to_string()),
        ("__start".to_string(), pct(&table.steps[table.start].id)),
    ];
    for s in &table.steps {
        let mut parts: Vec<String> = Vec::new();
        if s.guard.is_some() {
            // Pass-through: whatever `model` holds, both branches go where allowed requests go.
            let t = target(&s.on_match);
            out.push((s.id.clone(), format!("src=field&path=model&op=exists&match={t}&miss={t}")));
            continue;
        }
        match &s.source {
            Source::Field { path, .. } => {
                parts.push("src=field".into());
                parts.push(format!("path={}", pct(path)));
            }
            Source::Header(h) => {
                parts.push("src=header".into());
                parts.push(format!("name={}", pct(h)));
            }
            Source::Guard => {}
        }
        parts.push(format!("op={}", s.op.as_str()));
        let value = match (&s.cond, &s.value) {
            (Cond::Exists, _) | (_, None) => None,
            (Cond::OneOf(xs), _) => {
                Some(xs.iter().map(|x| pct(&scalar_text(x))).collect::<Vec<_>>().join(","))
            }
            (_, Some(v)) => Some(pct(&scalar_text(v))),
        };
        if let Some(v) = value {
            parts.push(format!("value={v}"));
        }
        parts.push(format!("match={}", target(&s.on_match)));
        parts.push(format!("miss={}", target(&s.on_miss)));
        if let Some(sp) = split(&s.on_match) {
            parts.push(format!("match_split={sp}"));
        }
        if let Some(sp) = split(&s.on_miss) {
            parts.push(format!("miss_split={sp}"));
        }
        out.push((s.id.clone(), parts.join("&")));
    }
    out
}

/// One line per guard step: what the export does with it and what keeping it takes.
pub fn guard_warnings(table: &RouteTable) -> Vec<String> {
    table
        .steps
        .iter()
        .filter(|s| s.guard.is_some())
        .map(|s| {
            format!(
                "step {} is a guard step: the iRule cannot run it, so it is exported as a pass-through and requests reach {} UNCHECKED on BIG-IP. Guard steps need the proxy (put it in the path), or a BIG-IP-side equivalent (an iRule calling the guard service with HTTP::collect + sideband, not shipped here).",
                s.id,
                table.describe_target(&s.on_match)
            )
        })
        .collect()
}

/// The table as a `ltm data-group internal` block (bigip.conf syntax; load it with
/// `tmsh load sys config merge file FILE`).
pub fn tmsh(table: &RouteTable, cfg: &ProxyConfig, name: &str) -> String {
    let mut s = String::new();
    s.push_str("# Generated by `llm-load-controller proxy export-bigip`: the proxy's routing table as a data group\n");
    s.push_str("# for deploy/bigip/irule/llm_route.tcl. Load: tmsh load sys config merge file THIS_FILE\n");
    for w in guard_warnings(table) {
        s.push_str(&format!("# WARNING: {w}\n"));
    }
    s.push_str(&format!("ltm data-group internal {name} {{\n    records {{\n"));
    for (k, v) in records(table, cfg) {
        s.push_str(&format!("        {k} {{\n            data \"{v}\"\n        }}\n"));
    }
    s.push_str("    }\n    type string\n}\n");
    s
}

/// The same data group as an iControl REST body: `POST /mgmt/tm/ltm/data-group/internal` to create
/// it, or `PATCH /mgmt/tm/ltm/data-group/internal/~Common~NAME` with it to replace the records.
pub fn icontrol_rest(table: &RouteTable, cfg: &ProxyConfig, name: &str) -> Value {
    let (partition, short) = match name.strip_prefix('/').and_then(|n| n.split_once('/')) {
        Some((p, n)) => (p.to_string(), n.to_string()),
        None => ("Common".to_string(), name.to_string()),
    };
    let records: Vec<Value> =
        records(table, cfg).into_iter().map(|(k, v)| json!({"name": k, "data": v})).collect();
    let mut body = json!({"name": short, "partition": partition, "type": "string", "records": records});
    let warnings = guard_warnings(table);
    if !warnings.is_empty() {
        body["description"] = Value::String(warnings.join(" "));
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const CFG: &str = "# proxy config\npools:\n  - name: chat\n    members: ['127.0.0.1:1']\n    bigip_pool: /Common/llm_chat\n  - name: lora\n    members: ['127.0.0.1:2']\nroutes:\n  steps:\n    - id: model\n      field: model\n      op: one-of\n      value: ['a,b', sql]\n      match: { pool: lora, model_split: { sql-v1: 90, sql-v2: 10 } }\n      miss: { step: tier }\n    - id: tier\n      header: X-Tier\n      op: equals\n      value: gold\n      match: { pool: chat }\n      miss: { reject: 404, message: \"no route & no luck\" }\n";

    #[test]
    fn records_encode_every_step() {
        let l = super::super::config::parse(Path::new("p.yaml"), CFG).unwrap();
        let r = records(&l.table, &l.config);
        assert_eq!(r[1], ("__start".into(), "model".into()));
        assert_eq!(
            r[2].1,
            "src=field&path=model&op=one-of&value=a%2Cb,sql&match=pool:lora&miss=step:tier&match_split=sql-v1*90,sql-v2*10"
        );
        assert_eq!(
            r[3].1,
            "src=header&name=x-tier&op=equals&value=gold&match=pool:/Common/llm_chat&miss=reject:404:no%20route%20%26%20no%20luck"
        );
        let t = tmsh(&l.table, &l.config, "/Common/llm_routes");
        assert!(
            t.contains("ltm data-group internal /Common/llm_routes {") && t.contains("type string"),
            "{t}"
        );
        let j = icontrol_rest(&l.table, &l.config, "/Common/llm_routes");
        assert_eq!(j["name"], "llm_routes");
        assert_eq!(j["partition"], "Common");
        assert_eq!(j["records"].as_array().map(Vec::len), Some(4));
    }
}
