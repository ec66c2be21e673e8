//! The BIG-IP iRule (deploy/bigip/irule/llm_route.tcl) walks the exported data group to the same
//! decision as the proxy, for many request bodies.
//!
//! No BIG-IP runs here, so the iRule runs under the real Tcl interpreter (`tclsh`) with the BIG-IP
//! commands it uses (`when`, `call`, `class match`, `HTTP::*`, `URI::decode`, `JSON::*`) defined as a
//! small double that follows F5's documented behaviour. That checks the iRule's own Tcl, the record
//! encoding and the walk, not BIG-IP itself: the iRule stays marked untested on a real BIG-IP.

use std::path::Path;
use std::process::Command;

use axum::http::HeaderMap;
use llm_lc_proxy::{bigip, config, Target};
use serde_json::{json, Value};

/// Tcl string literal.
fn tq(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '$' => out.push_str("\\$"),
            '[' => out.push_str("\\["),
            ']' => out.push_str("\\]"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON value as the double's element handle: `[list TYPE VALUE]`, with BIG-IP's type names
/// (integers are `integer`, other numbers `literal`).
fn tcl_json(v: &Value) -> String {
    match v {
        Value::Null => "[list null {}]".into(),
        Value::Bool(b) => format!("[list boolean {b}]"),
        Value::Number(n) if n.is_i64() || n.is_u64() => format!("[list integer {n}]"),
        Value::Number(n) => format!("[list literal {}]", tq(&n.to_string())),
        Value::String(s) => format!("[list string {}]", tq(s)),
        Value::Array(a) => {
            format!("[list array [list {}]]", a.iter().map(tcl_json).collect::<Vec<_>>().join(" "))
        }
        Value::Object(o) => format!(
            "[list object [list {}]]",
            o.iter().map(|(k, v)| format!("{} {}", tq(k), tcl_json(v))).collect::<Vec<_>>().join(" ")
        ),
    }
}

const DOUBLE: &str = r#"
namespace eval static {}
proc when { event body } { proc ::event_$event {} $body }
proc call { name args } { uplevel 1 [list $name {*}$args] }
proc log { args } {}
proc pool { name } { set ::out [list pool $name] }
proc class { args } {
    # class match -value KEY equals DATAGROUP
    lassign $args sub flag key op dg
    if { $sub ne "match" || $flag ne "-value" || $op ne "equals" } { error "double: unsupported class form $args" }
    if { $dg ne $::dg_name } { error "double: no data group $dg" }
    if { [info exists ::records($key)] } { return $::records($key) }
    return ""
}
namespace eval URI {
    proc decode { s } {
        set s [string map {\\ \\\\ [ \\[ ] \\] $ \\$} $s]
        set s [regsub -all {%([0-9A-Fa-f]{2})} $s {\\x\1}]
        return [encoding convertfrom utf-8 [subst -nocommands -novariables $s]]
    }
}
namespace eval HTTP {
    proc method {} { return POST }
    proc collect { n } { set ::collected $n }
    proc release {} { set ::released 1 }
    proc respond { status args } { set ::out [list respond $status [lindex $args 1]] }
    proc payload { args } {
        if { [llength $args] == 0 } { return $::payload }
        switch -- [lindex $args 0] {
            length { return [string length $::payload] }
            replace { set ::payload [lindex $args 3]; return }
        }
        error "double: unsupported HTTP::payload $args"
    }
    proc header { args } {
        set sub [lindex $args 0]
        switch -- $sub {
            exists { return [info exists ::hdr([string tolower [lindex $args 1]])] }
            value { return $::hdr([string tolower [lindex $args 1]]) }
            replace { set ::hdr([string tolower [lindex $args 1]]) [lindex $args 2]; return }
            default {
                set k [string tolower $sub]
                if { [info exists ::hdr($k)] } { return $::hdr($k) }
                return ""
            }
        }
    }
}
namespace eval JSON {
    proc parse { s } {
        if { ![info exists ::tree] } { error "invalid JSON" }
        return [list cache $::tree]
    }
    proc root { cache } { return [lindex $cache 1] }
    proc type { e } { return [lindex $e 0] }
    proc get { e args } {
        set t [lindex $e 0]
        if { [llength $args] && [lindex $args 0] ne $t } { error "JSON::get: element is $t, not [lindex $args 0]" }
        if { $t eq "object" || $t eq "array" } { return $e }
        return [lindex $e 1]
    }
    proc object { sub o args } {
        if { [lindex $o 0] ne "object" } { error "JSON::object on [lindex $o 0]" }
        set kv [lindex $o 1]
        switch -- $sub {
            keys { set ks {}; foreach {k v} $kv { lappend ks $k }; return $ks }
            get { foreach {k v} $kv { if { $k eq [lindex $args 0] } { return $v } }; error "JSON::object get: no key [lindex $args 0]" }
        }
        error "double: unsupported JSON::object $sub"
    }
    proc array { sub a args } {
        if { [lindex $a 0] ne "array" } { error "JSON::array on [lindex $a 0]" }
        set items [lindex $a 1]
        switch -- $sub {
            size { return [llength $items] }
            get { return [lindex $items [lindex $args 0]] }
        }
        error "double: unsupported JSON::array $sub"
    }
}
"#;

struct Case {
    body: Value,
    headers: Vec<(&'static str, &'static str)>,
}

/// Run the iRule on each case; one output line per case.
fn run_irule(records: &[(String, String)], dg: &str, cases: &[Case]) -> Vec<String> {
    let irule = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/bigip/irule/llm_route.tcl"),
    )
    .expect("the iRule exists");
    let mut script = String::from(DOUBLE);
    script.push_str(&format!("set ::dg_name {}\n", tq(dg)));
    for (k, v) in records {
        script.push_str(&format!("array set ::records [list {} {}]\n", tq(k), tq(v)));
    }
    script.push_str(&irule);
    script.push_str(&format!("\nevent_RULE_INIT\nset static::llm_dg {}\n", tq(dg)));
    for c in cases {
        let text = c.body.to_string();
        script.push_str(
            "catch {unset ::hdr}; array set ::hdr {}; set ::out {none}; catch {unset ::collected}\n",
        );
        script.push_str(&format!("set ::payload {}\nset ::tree {}\n", tq(&text), tcl_json(&c.body)));
        script.push_str(&format!("set ::hdr(content-length) {}\n", text.len()));
        for (k, v) in &c.headers {
            script.push_str(&format!("array set ::hdr [list {} {}]\n", tq(&k.to_ascii_lowercase()), tq(v)));
        }
        script.push_str(
            "event_HTTP_REQUEST\nif { [info exists ::collected] } { event_HTTP_REQUEST_DATA }\n\
             set route {}; if { [info exists ::hdr(x-llmlc-route)] } { set route $::hdr(x-llmlc-route) }\n\
             set model {}; regexp {\"model\":\"([^\"]*)\"} $::payload -> model\n\
             puts [list {*}$::out $route $model]\n",
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.tcl");
    std::fs::write(&path, &script).unwrap();
    let out = Command::new("tclsh").arg(&path).output().expect("tclsh runs (Debian package tcl)");
    assert!(out.status.success(), "the iRule failed under tclsh:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
}

/// What the proxy decides, in the iRule's output words.
fn proxy_says(l: &config::Loaded, c: &Case) -> (String, String, Option<Vec<String>>) {
    let mut h = HeaderMap::new();
    for (k, v) in &c.headers {
        h.insert(*k, v.parse().unwrap());
    }
    let d = l.table.evaluate(&c.body, &h);
    match &d.target {
        Target::Pool { pool, split } => {
            let p = l.config.pools.iter().find(|p| &p.name == pool).unwrap();
            let models = split.map(|k| l.table.splits[k].models.iter().map(|(m, _)| m.clone()).collect());
            // Guard steps are pass-throughs in the iRule (`guard:match`), `guard:allow` in the proxy:
            // compare the route after them.
            let route = d.route(&l.table);
            let route = route.split(',').filter(|h| !h.starts_with("guard:")).collect::<Vec<_>>().join(",");
            (format!("pool {}", p.bigip_pool.clone().unwrap_or(pool.clone())), route, models)
        }
        Target::Reject { status, .. } => (format!("respond {status}"), String::new(), None),
        Target::Step(_) => unreachable!(),
    }
}

fn check(l: &config::Loaded, cases: &[Case]) {
    let lines = run_irule(&bigip::records(&l.table, &l.config), "/Common/llm_routes", cases);
    assert_eq!(lines.len(), cases.len(), "{lines:?}");
    for (c, line) in cases.iter().zip(&lines) {
        let (want, route, split) = proxy_says(l, c);
        assert!(
            line.starts_with(&want),
            "body {} headers {:?}: iRule said {line:?}, proxy {want:?}",
            c.body,
            c.headers
        );
        if want.starts_with("pool") {
            assert!(line.contains(&route), "route: iRule {line:?}, proxy {route:?}");
        }
        if let Some(models) = split {
            assert!(
                models.iter().any(|m| line.ends_with(&format!(" {m}"))),
                "split rewrote the model: {line:?}"
            );
        }
    }
}

#[test]
fn irule_decides_like_the_proxy_on_the_example_table() {
    let l = config::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("config/proxy.yaml")).unwrap();
    let b = |body: Value| Case { body, headers: vec![] };
    let cases = vec![
        b(json!({"model": "llama-70b", "messages": [{"role": "user", "content": "hi"}]})),
        b(json!({"model": "sql-lora", "messages": [{"role": "user", "content": "select"}]})),
        b(json!({"model": "llama-8b", "metadata": {"interactive": true}, "messages": []})),
        b(json!({"model": "llama-8b", "metadata": {"interactive": "true"}, "messages": []})),
        b(
            json!({"model": "llama-8b", "messages": [{"role": "system", "content": "be \"brief\" [x] $y \\ z"}]}),
        ),
        b(json!({"model": "llama-8b", "messages": [{"role": "user", "content": "batch"}]})),
        b(json!({"model": "llama-8b"})),
        b(json!({"model": "gpt-9", "messages": []})),
        b(json!({"model": 70, "messages": "nope"})),
        b(json!({"messages": [[], {}, null]})),
        b(json!({})),
    ];
    check(&l, &cases);
}

#[test]
fn irule_decides_like_the_proxy_on_every_comparison_and_source() {
    let yaml = r#"# proxy config
pools:
  - { name: a, members: ['127.0.0.1:1'] }
  - { name: b, members: ['127.0.0.1:2'], bigip_pool: /Tenant/pool_b }
  - { name: c, members: ['127.0.0.1:3'] }
routes:
  steps:
    - { id: tier, header: X-Tier, op: one-of, value: [gold, "plat inum"], match: { pool: a }, miss: { step: last-role } }
    - { id: last-role, field: messages.-1.role, op: not-equals, value: user, match: { pool: b }, miss: { step: short } }
    - { id: short, field: max_tokens, op: less-than, value: 16, match: { pool: c }, miss: { step: long } }
    - { id: long, field: max_tokens, op: greater-than, value: 4000, match: { reject: 413, message: "too long & too much" }, miss: { step: adapter } }
    - { id: adapter, field: model, op: prefix, value: "lora-", match: { pool: c }, miss: { step: re } }
    - { id: re, field: user, op: regex, value: "^team-[0-9]+$", match: { pool: b }, miss: { step: has-tools } }
    - { id: has-tools, field: tools, op: exists, match: { pool: a }, miss: { reject: 404 } }
"#;
    let l = config::parse(Path::new("inline.yaml"), yaml).unwrap();
    let u = || json!([{"role": "user", "content": "x"}]);
    let case = |body: Value, headers: Vec<(&'static str, &'static str)>| Case { body, headers };
    let cases = vec![
        case(json!({"messages": u()}), vec![("X-Tier", "gold")]),
        case(json!({"messages": u()}), vec![("X-Tier", "plat inum")]),
        case(json!({"messages": u(), "max_tokens": 100}), vec![("X-Tier", "silver")]),
        case(json!({"messages": [{"role": "user"}, {"role": "assistant"}]}), vec![]),
        case(json!({"messages": u(), "max_tokens": 8}), vec![]),
        case(json!({"messages": u(), "max_tokens": 15.5}), vec![]),
        case(json!({"messages": u(), "max_tokens": 5000}), vec![]),
        case(json!({"messages": u(), "max_tokens": 100, "model": "lora-sql"}), vec![]),
        case(json!({"messages": u(), "max_tokens": 100, "model": "base", "user": "team-42"}), vec![]),
        case(json!({"messages": u(), "max_tokens": 100, "model": "base", "user": "team-x"}), vec![]),
        case(json!({"messages": u(), "max_tokens": 100, "tools": []}), vec![]),
        case(json!({"messages": u(), "max_tokens": 100}), vec![]),
        case(json!({"messages": []}), vec![]),
    ];
    check(&l, &cases);
}
