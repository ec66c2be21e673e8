//! Sideband mode for CIS/AS3-owned pools: the controller writes nothing to BIG-IP, and the iRule
//! (deploy/bigip/irule/sideband.tcl) pulls `/v1/ratios/POOL` and weights its member choice by it.
//!
//! No BIG-IP runs here, so the iRule runs under the real Tcl interpreter with the BIG-IP commands it
//! uses defined as a double written from F5's iRule reference: `table` (subtables, lifetimes on a
//! clock the test moves), `connect`/`send`/`recv`/`close` over real TCP sockets to the running
//! controller, `active_members`, `LB::server pool`, `pool ... member`. Connections are namespaces, so
//! variables live per connection as in a real iRule.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use llm_lc_testkit::bigip::{BigIpDouble, MemberSpec, PoolSpec, Role, UserSpec};
use llm_lc_testkit::irule;
use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::{ports, wait};

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");

/// Run the double, the iRule and `driver` in tclsh; its stdout.
fn tclsh(driver: &str) -> String {
    irule::tclsh(&Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/bigip/irule/sideband.tcl"), driver)
}

struct Controller {
    child: Child,
    listen: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sideband_irule_weights_members_by_the_controllers_ratios_and_bigip_is_never_written() {
    let targets = vec![
        MetricsTarget::vllm(0.0, 2.0, 0.10).await,
        MetricsTarget::vllm(2.0, 20.0, 0.50).await,
        MetricsTarget::vllm(12.0, 60.0, 0.95).await,
    ];
    let members: Vec<String> = targets.iter().map(MetricsTarget::member).collect();
    let bigip = BigIpDouble::start().await;
    bigip.add_user(UserSpec::new("svc-llm", "pw", Role::ApplicationEditor));
    let mut pool = PoolSpec::new("/Common/llm_pool").mode("least-connections-member");
    for t in &targets {
        pool = pool.member(MemberSpec::ip("127.0.0.1", t.addr.port()));
    }
    bigip.add_pool(pool);

    let dir = tempfile::tempdir().expect("tmp");
    let listen = ports::free_port();
    let cfg = dir.path().join("controller.yaml");
    std::fs::write(
        &cfg,
        format!(
            "interval: 300ms\nlisten: 127.0.0.1:{listen}\nsources:\n  direct: {{ kind: scrape, timeout: 1s }}\n\
             pools:\n  - name: llm\n    source: direct\n    members: {{ from_lb: true }}\n    sink:\n      kind: f5\n      \
             mode: sideband\n      url: '{}'\n      pool: /Common/llm_pool\n      username: svc-llm\n      password: {{ value: pw }}\n",
            bigip.url()
        ),
    )
    .expect("config");
    let child = Command::new(BIN)
        .args(["run", "--config"])
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start controller");
    let controller = Controller { child, listen, _dir: dir };

    // The controller's text for the pool, once every member has a ratio.
    let url = format!("http://127.0.0.1:{}/v1/ratios/llm", controller.listen);
    let text = wait::until(Duration::from_secs(20), "ratios for every member", || async {
        let t = reqwest::get(&url).await.ok()?.text().await.ok()?;
        (members.iter().all(|m| t.contains(&m.replace(':', " ")))).then_some(t)
    })
    .await;
    let ratios: BTreeMap<String, f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            Some((format!("{} {}", f.first()?, f.get(1)?), f.get(2)?.parse().ok()?))
        })
        .collect();
    assert_eq!(ratios.len(), 3, "{text}");

    let active: Vec<String> = targets.iter().map(|t| format!("{{127.0.0.1 {}}}", t.addr.port())).collect();
    let driver = format!(
        r#"
set static::llmlc_controller "127.0.0.1:{port}"
set static::llmlc_pools [list /Common/llm_pool llm]
set ::cur_pool /Common/llm_pool
set ::active(/Common/llm_pool) [list {active}]
proc run {{ n tag }} {{
    for {{set i 0}} {{$i < $n}} {{incr i}} {{
        set ::picked ""
        # 24 keep-alive connections: each new request ends that connection's previous one.
        fire [expr {{$i % 24}}] HTTP_REQUEST
        if {{ $::picked eq "" }} {{ incr ::count($tag,none) }} else {{ incr ::count($tag,[lrange $::picked 2 3]) }}
    }}
    puts "connects $tag $::connects"
}}
run 1200 steady
set ::now 6
run 10 refreshed
# The controller gone for longer than the ratios live: the pool's own mode decides again.
set static::llmlc_controller "127.0.0.1:1"
set ::now 70
run 10 gone
foreach k [lsort [array names ::count]] {{ puts "pick $k $::count($k)" }}
foreach l $::logs {{ puts "log $l" }}
"#,
        port = controller.listen,
        active = active.join(" "),
    );
    let out = tclsh(&driver);
    let line_value = |prefix: &str| -> Option<u64> {
        out.lines().find_map(|l| l.strip_prefix(prefix)).and_then(|v| v.trim().parse().ok())
    };
    assert_eq!(line_value("connects steady "), Some(1), "one fetch while the refresh period lasts:\n{out}");
    assert_eq!(line_value("connects refreshed "), Some(2), "fetched again after it:\n{out}");

    // Picks follow the ratios: each member's share of 1200 within 5 points of its ratio share.
    let total: f64 = ratios.values().sum();
    for (member, r) in &ratios {
        let picks = line_value(&format!("pick steady,{member} ")).unwrap_or(0) as f64;
        let (got, want) = (picks / 1200.0, r / total);
        assert!((got - want).abs() < 0.05, "{member}: {got:.3} of picks, ratio share {want:.3}\n{out}");
    }
    assert_eq!(line_value("pick steady,none "), None, "every request weighted:\n{out}");
    assert_eq!(line_value("pick gone,none "), Some(10), "no ratios left, the pool decides:\n{out}");
    assert!(out.contains("log llmlc: cannot connect"), "{out}");

    let writes: Vec<_> = bigip
        .requests()
        .into_iter()
        .filter(|r| r.method != "GET" && !r.path.starts_with("/mgmt/shared/"))
        .collect();
    assert!(writes.is_empty(), "sideband mode wrote to BIG-IP: {writes:?}");
    assert!(bigip.ratios("/Common/llm_pool").values().all(|&r| r == 1));
}

/// Prefix affinity in the sideband iRule, with ratios already in its table (no controller needed:
/// the fetch lock is held, so it keeps what is there): a key stays on one member while that member
/// is under its bound, spills when it is over, and the members' shares of the keys follow their
/// ratios; a request without the key gets the weighted least-connections pick.
#[test]
fn the_sideband_irule_keeps_a_prefix_key_on_one_member_under_its_bound() {
    let driver = r#"
set static::llmlc_pools [list /Common/llm_pool llm]
set ::cur_pool /Common/llm_pool
set ::active(/Common/llm_pool) [list {10.0.0.1 8000} {10.0.0.2 8000} {10.0.0.3 8000}]
table add -subtable llmlc_fetch llm held indefinite 100000
proc ratios { a b c } {
    foreach m {{10.0.0.1 8000} {10.0.0.2 8000} {10.0.0.3 8000}} r [list $a $b $c] {
        table set -subtable llmlc_ratio:llm $m $r indefinite 100000
    }
}
set ::conn 0
# One request on a new connection; `close` ends it (CLIENT_CLOSED) before the next one.
proc req { key close } {
    set ::picked ""
    if { $key eq "" } { set ::hdr {} } else { set ::hdr [dict create x-llm-prefix-key $key] }
    set c [incr ::conn]
    fire $c HTTP_REQUEST
    if { $close } { fire $c CLIENT_CLOSED }
    return [lindex $::picked 2]
}
ratios 50 50 50
# 12 keys, 6 requests each, one at a time.
for {set k 0} {$k < 12} {incr k} {
    set seen {}
    for {set i 0} {$i < 6} {incr i} { lappend seen [req "session-$k" 1] }
    puts "key session-$k [lsort -unique $seen]"
}
# 12 requests of one key kept in flight at once, then one more after they end.
set first $::conn
set burst {}
for {set i 0} {$i < 12} {incr i} { lappend burst [req "session-0" 0] }
foreach m [lsort -unique $burst] { puts "burst $m [llength [lsearch -all -exact $burst $m]]" }
for {set c [expr {$first + 1}]} {$c <= $::conn} {incr c} { fire $c CLIENT_CLOSED }
puts "after [req session-0 1]"
# Shares of 600 keys at equal ratios and at 10:10:60.
foreach {tag a b c} {even 50 50 50 weighted 10 10 60} {
    ratios $a $b $c
    for {set k 0} {$k < 600} {incr k} { incr ::share($tag,[req "$tag-$k" 1]) }
}
foreach k [lsort [array names ::share]] { puts "share $k $::share($k)" }
# No key: the weighted least-connections pick, which spreads requests held in flight.
set nokey {}
for {set i 0} {$i < 8} {incr i} { lappend nokey [req "" 0] }
puts "nokey [llength [lsort -unique $nokey]]"
"#;
    let out = tclsh(driver);
    eprintln!("{}", out.lines().filter(|l| !l.starts_with("key ")).collect::<Vec<_>>().join("\n"));
    let mut homes = std::collections::BTreeSet::new();
    for l in out.lines().filter(|l| l.starts_with("key ")) {
        let f: Vec<&str> = l.split(' ').collect();
        assert_eq!(f.len(), 3, "a key on more than one member: {l}\n{out}");
        homes.insert(f[2].to_string());
    }
    assert_eq!(out.lines().filter(|l| l.starts_with("key ")).count(), 12, "{out}");
    assert!(homes.len() >= 2, "12 keys all on {homes:?}");
    let home = out
        .lines()
        .find(|l| l.starts_with("key session-0 "))
        .and_then(|l| l.split(' ').nth(2))
        .expect("home");
    let burst: BTreeMap<String, u64> = out
        .lines()
        .filter_map(|l| l.strip_prefix("burst "))
        .filter_map(|l| l.split_once(' ').map(|(m, n)| (m.to_string(), n.parse().unwrap_or(0))))
        .collect();
    assert!(burst.len() >= 2, "the burst never left its member: {burst:?}");
    assert!(burst.get(home).copied().unwrap_or(0) >= 4, "home {home} keeps its share: {burst:?}");
    assert!(burst.values().all(|&n| n <= 8), "a member over the bound: {burst:?}");
    assert!(out.contains(&format!("after {home}")), "the key goes home after the burst:\n{out}");
    let share = |tag: &str, m: &str| -> f64 {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("share {tag},{m} ")))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
            / 600.0
    };
    for m in ["10.0.0.1", "10.0.0.2", "10.0.0.3"] {
        assert!(
            (0.25..=0.42).contains(&share("even", m)),
            "{m} at equal ratios: {}\n{out}",
            share("even", m)
        );
    }
    assert!((0.65..=0.85).contains(&share("weighted", "10.0.0.3")), "ratio 60 of 80:\n{out}");
    assert!(out.contains("nokey 3"), "requests without a key spread by load:\n{out}");
}
