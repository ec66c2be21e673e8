//! The BIG-IP picker iRule (deploy/bigip/irule/picker.tcl) under the real Tcl interpreter, against
//! the double of BIG-IP's commands (`llm_lc_testkit::irule`), calling a running controller's
//! picker sideband door over real sockets (issue 42): a prompt's requests go to one member, other
//! prompts spread, only active members are ever selected, and a picker that is slow, gone or has
//! nothing to say leaves the choice to the pool, within the iRule's timeout.

use std::path::Path;
use std::time::Duration;

use llm_lc_sim::ModelProfile;
use llm_lc_testkit::controller::Running;
use llm_lc_testkit::{irule, ports, sim, wait};
use serde_json::json;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_llm-load-controller"))
}

fn run(driver: &str) -> String {
    irule::tclsh(&Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/bigip/irule/picker.tcl"), driver)
}

/// A chat body for `doc`, as Tcl words (braces: JSON's own braces balance, it has no backslashes).
fn body(doc: usize, question: usize) -> String {
    let doc = format!("document {doc}: ") + &"the same long context, sent again and again. ".repeat(25);
    json!({"model": "sim-tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": doc}, {"role": "user", "content": format!("question {question}")}]})
    .to_string()
}

/// The driver's helpers: `req BODY` fires one request with that body on a new connection and
/// returns the member picked ("" when the pool decides).
const REQ: &str = r#"
set ::cur_pool /Common/llm_pool
set ::conn 0
proc req { body } {
    set ::picked ""
    set ::payload $body
    set ::hdr [dict create content-length [string length $body]]
    set c [incr ::conn]
    fire $c HTTP_REQUEST
    if { $::collect > 0 } { fire $c HTTP_REQUEST_DATA; set ::collect 0 }
    return [lrange $::picked 2 3]
}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_irule_keeps_a_prompt_on_one_member_and_never_leaves_the_active_ones() {
    let fleet = sim::fleet(ModelProfile::tiny(), &[1.0, 1.0, 1.0], |_| {}).await;
    let door = ports::free_port();
    let members: Vec<String> = fleet.addrs().iter().map(|a| format!("'{a}'")).collect();
    let c = Running::start(
        bin(),
        "500ms",
        &format!(
            "sources:\n  direct: {{ kind: scrape, timeout: 1s }}\npools:\n  - name: llm\n    source: direct\n    members: {{ static: [{}] }}\n    picker: {{ http: '127.0.0.1:{door}', refresh: 50ms }}\n",
            members.join(", ")
        ),
    );
    // The door answers a member once the first cycle gave the picker its members.
    wait::until_or(
        Duration::from_secs(15),
        "the picker door answering a member",
        || async {
            let r = reqwest::Client::new()
                .post(format!("http://127.0.0.1:{door}/pick/llm"))
                .body("x")
                .send()
                .await
                .ok()?;
            let text = r.text().await.ok()?;
            (text.trim() != "fallback").then_some(())
        },
        || c.log(),
    )
    .await;
    let active: Vec<String> = fleet.addrs().iter().map(|a| format!("{{{} {}}}", a.ip(), a.port())).collect();
    let mut driver = format!(
        "set static::llmlc_picker \"127.0.0.1:{door}\"\nset static::llmlc_picker_pools [list /Common/llm_pool llm]\nset static::llmlc_picker_timeout_ms 1000\nset ::active(/Common/llm_pool) [list {}]\n{REQ}",
        active.join(" ")
    );
    for q in 0..6 {
        driver += &format!("puts \"same [req {{{}}}]\"\n", body(0, q));
    }
    for d in 1..13 {
        driver += &format!("puts \"other [req {{{}}}]\"\n", body(d, 0));
    }
    // Two members active (one drained on the BIG-IP): only they are ever answered.
    driver += &format!("set ::active(/Common/llm_pool) [list {} {}]\n", active[0], active[2]);
    for d in 20..32 {
        driver += &format!("puts \"two [req {{{}}}]\"\n", body(d, 0));
    }
    driver += "puts \"released $::released\"\n";
    let out = run(&driver);
    let picks = |tag: &str| -> Vec<String> {
        out.lines().filter_map(|l| l.strip_prefix(&format!("{tag} "))).map(str::to_string).collect()
    };
    let same = picks("same");
    assert_eq!(same.len(), 6, "{out}");
    assert!(!same[0].is_empty() && same.iter().all(|p| *p == same[0]), "one member for the prompt: {same:?}");
    let others: std::collections::BTreeSet<String> = picks("other").into_iter().collect();
    assert!(others.len() >= 2 && !others.contains(""), "other prompts spread over members: {others:?}");
    let allowed =
        [active[0].trim_matches(['{', '}']).to_string(), active[2].trim_matches(['{', '}']).to_string()];
    for p in picks("two") {
        assert!(allowed.contains(&p), "{p} is not active on the BIG-IP ({allowed:?})");
    }
    assert!(out.contains("released 30"), "every collected body released: {out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_gone_or_unsure_picker_leaves_the_choice_to_the_pool_within_the_timeout() {
    // A picker that accepts and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let silent_port = silent.local_addr().expect("addr").port();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            conns.push(s);
        }
    });
    // One that answers `fallback` (it has no members for the pool).
    let unsure = llm_lc_testkit::envoy::serve(
        axum::Router::new().route("/pick/{pool}", axum::routing::post(|| async { "fallback\n" })),
    )
    .await;
    let gone = ports::refused();
    let driver = format!(
        "set static::llmlc_picker_pools [list /Common/llm_pool llm]\nset static::llmlc_picker_timeout_ms 20\nset ::active(/Common/llm_pool) [list {{10.0.0.1 8000}} {{10.0.0.2 8000}}]\n{REQ}
foreach {{tag at}} [list silent 127.0.0.1:{silent_port} gone {gone} unsure {unsure}] {{
    set static::llmlc_picker $at
    set t0 [clock milliseconds]
    set p [req {{{body}}}]
    puts \"$tag picked=\\\"$p\\\" ms=[expr {{[clock milliseconds] - $t0}}]\"
}}
",
        gone = gone.addr,
        unsure = unsure.addr(),
        body = body(0, 0),
    );
    let out = run(&driver);
    held.abort();
    for tag in ["silent", "gone", "unsure"] {
        let line = out.lines().find(|l| l.starts_with(tag)).unwrap_or_else(|| panic!("{tag}: {out}"));
        assert!(line.contains("picked=\"\""), "the pool decides: {line}");
        let ms: u64 = line.rsplit("ms=").next().and_then(|v| v.trim().parse().ok()).unwrap_or(u64::MAX);
        // connect, send and recv are each bounded by 20 ms.
        assert!(ms < 500, "{line}");
    }
}
