//! Names from the attacker's side, through a real Prometheus: target `instance` labels carrying
//! quotes, backslashes, line breaks with forged lines after them, spaces and HTML, beside valid
//! members, read by `run --dry-run --prometheus URL`. Every output must stay what it was:
//! `/metrics` passes `promtool check metrics` and has no series we did not expect, the sideband
//! feed has one line per valid member, stderr one log record per line, stdout one table record
//! per line, `/v1/ratios` and `/v1/history` parse as JSON. The refused names are counted without
//! the name and the valid members still get ratios.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use llm_lc_testkit::metrics_target::MetricsTarget;
use llm_lc_testkit::prometheus::Prometheus;
use llm_lc_testkit::{ports, wait};
use serde_json::Value;

const FORGED_SERIES: &str = "evil\"} 1\nllmlc_forged_series{a=\"b";
const FORGED_FEED: &str = "10.0.0.9:80\n10.6.6.6 80 100";
const FORGED_LOG: &str = "x:80\n2026-12-06T00:00:00.000000Z  INFO forged: all is well";
const HOSTILE: [&str; 6] =
    [FORGED_SERIES, "a\\b:80", FORGED_FEED, "has space:80", "<script>alert(1)</script>:80", FORGED_LOG];
const VALID: [&str; 3] = ["10.0.0.1:8000", "vllm-0.vllm.llm.svc:8000", "10.0.0.2%3:8000"];

struct Controller {
    child: Child,
    listen: u16,
    dir: tempfile::TempDir,
}

impl Controller {
    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(file)).unwrap_or_default()
    }

    async fn get(&self, path: &str) -> String {
        let url = format!("http://127.0.0.1:{}{path}", self.listen);
        match reqwest::get(url).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn promtool() -> PathBuf {
    let debian = PathBuf::from("/usr/bin/promtool");
    if debian.exists() {
        debian
    } else {
        "promtool".into()
    }
}

/// `promtool check metrics` on `page`: its exit status and what it said.
fn promtool_check(page: &str) -> (bool, String) {
    use std::io::Write as _;
    let mut child = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package `prometheus`, installed by tests/run.sh)");
    child.stdin.take().expect("stdin").write_all(page.as_bytes()).expect("write page");
    let out = child.wait_with_output().expect("promtool runs");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), said)
}

/// Label values of `label` in every sample line of an exposition page, unescaped.
fn label_values(page: &str, label: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let key = format!("{label}=\"");
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        let mut rest = line;
        while let Some(i) = rest.find(&key) {
            let before_ok = i == 0 || matches!(rest.as_bytes()[i - 1], b'{' | b',');
            rest = &rest[i + key.len()..];
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let mut end = rest.len();
            while let Some((j, c)) = chars.next() {
                match c {
                    '\\' => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c)) => value.push(c),
                        None => break,
                    },
                    '"' => {
                        end = j + 1;
                        break;
                    }
                    c => value.push(c),
                }
            }
            rest = &rest[end..];
            if before_ok {
                out.insert(value);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_instance_labels_break_no_output_and_valid_members_still_get_ratios() {
    let target = MetricsTarget::vllm(1.0, 8.0, 0.4).await;
    let addr = [target.member()];
    let labels: Vec<[(&str, &str); 1]> =
        HOSTILE.iter().chain(&VALID).map(|name| [("instance", *name)]).collect();
    let groups: Vec<_> = labels.iter().map(|l| (&l[..], &addr[..])).collect();
    let prom = Prometheus::start_labelled("hostile", &groups).await;
    let all = HOSTILE.len() + VALID.len();
    let per_instance = "count by (instance) (vllm:num_requests_waiting{job=\"hostile\"})";
    prom.wait_for_series(per_instance, all, Duration::from_secs(30)).await;

    let dir = tempfile::tempdir().expect("tmp");
    let listen = ports::free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_llm-load-controller"))
        .args(["run", "--dry-run", "--interval", "1s", "--selector", "{job=\"hostile\"}"])
        .args(["--prometheus", &prom.url(), "--listen", &format!("127.0.0.1:{listen}")])
        .env("RUST_LOG", "info")
        .stdout(std::fs::File::create(dir.path().join("stdout")).expect("stdout file"))
        .stderr(std::fs::File::create(dir.path().join("stderr")).expect("stderr file"))
        .spawn()
        .expect("start controller");
    let c = Controller { child, listen, dir };

    // Three cycles with every valid member computed.
    let report =
        wait::until(Duration::from_secs(30), "3 cycles with ratios for the valid members", || async {
            let v: Value = serde_json::from_str(&c.get("/v1/ratios").await).ok()?;
            let pool = v["pools"].as_array()?.iter().find(|p| p["pool"] == "quickstart")?.clone();
            let members: BTreeSet<String> = pool["members"]
                .as_array()?
                .iter()
                .filter(|m| m["ratio"].as_u64().is_some_and(|r| r > 0))
                .filter_map(|m| Some(m["member"].as_str()?.to_string()))
                .collect();
            let cycles = c.read("stdout").lines().filter(|l| l.contains("pool quickstart")).count();
            (members.len() == VALID.len() && cycles >= 3).then_some(pool)
        })
        .await;
    let members: BTreeSet<&str> =
        report["members"].as_array().expect("members").iter().filter_map(|m| m["member"].as_str()).collect();
    assert_eq!(members, VALID.iter().copied().collect(), "exactly the valid members are in the pool");

    // /metrics: parses, no forged family, member labels only of valid members, the refusals counted.
    let page = c.get("/metrics").await;
    let (_, said) = promtool_check(&page);
    // promtool reads the classic text format, where a counter's HELP is under its `_total` name;
    // OpenMetrics puts it under the family name. That lint, for a family whose HELP is on the
    // page, is the only thing it may say: a parse error or any other finding fails.
    for line in said.lines().filter(|l| !l.trim().is_empty()) {
        let family = line.strip_suffix("_total no help text");
        let explained = family.is_some_and(|f| page.contains(&format!("# HELP {f} ")));
        assert!(explained, "promtool check metrics: {line:?}\n{said}\n{page}");
    }
    assert!(
        !page.lines().any(|l| l.starts_with("llmlc_forged_series")),
        "forged series on the page:\n{page}"
    );
    let labelled: BTreeSet<String> = label_values(&page, "member");
    assert!(
        labelled.iter().all(|m| VALID.contains(&m.as_str())),
        "member labels outside the valid members: {labelled:?}"
    );
    let refused = page
        .lines()
        .find(|l| l.starts_with("llmlc_member_errors_total{") && l.contains("reason=\"invalid_name\""))
        .unwrap_or_else(|| panic!("refusals are counted:\n{page}"));
    assert!(!refused.contains("member="), "no raw name in the label: {refused}");
    let count: f64 = refused.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a count");
    assert!(count >= 3.0 * HOSTILE.len() as f64, "each refusal counted each cycle: {refused}");

    // The sideband feed: a header and one line per valid member, three fields each.
    let feed = c.get("/v1/ratios/quickstart").await;
    let lines: Vec<&str> = feed.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(lines.len(), VALID.len(), "one line per valid member:\n{feed}");
    assert!(lines.iter().all(|l| l.split(' ').count() == 3), "address port ratio:\n{feed}");
    assert!(!feed.contains("10.6.6.6"), "no forged member line:\n{feed}");

    // JSON feeds parse; the status page is ours, static, and holds none of the names.
    assert!(serde_json::from_str::<Value>(&c.get("/v1/history").await).is_ok(), "history is JSON");
    assert!(!c.get("/").await.contains("alert(1)"), "the status page does not embed names");

    // Logs: one record per line, each refused name logged once (escaped), none forged.
    let log = c.read("stderr");
    let record = regex::Regex::new(r"^\S+Z\s+(TRACE|DEBUG|INFO|WARN|ERROR) ").expect("regex");
    for line in log.lines() {
        assert!(record.is_match(line), "a line that is not a log record: {line:?}\n{log}");
    }
    assert!(!log.lines().any(|l| l.starts_with("2026-12-06T00:00:00.000000Z")), "a forged record:\n{log}");
    let warned = log.lines().filter(|l| l.contains("not a member name")).count();
    assert!(
        log.contains(r#"name=evil\"\u{7d}\u{20}1\nllmlc_forged_series"#),
        "escaped in the record:\n{log}"
    );
    assert_eq!(warned, HOSTILE.len(), "each refused name once, not every cycle:\n{log}");

    // The dry-run table: pool headers, the column header and member lines; members all valid.
    let table = c.read("stdout");
    for line in table.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        let known = line.is_empty()
            || line.contains(" pool quickstart ")
            || first == "MEMBER"
            || first == "error:"
            || VALID.contains(&first);
        assert!(known, "a table line that is not a record: {line:?}\n{table}");
    }
}

/// Names made of the characters that break outputs, mixed with ordinary ones, and any UTF-8.
fn hostile_name() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let nasty = prop::sample::select(vec![
        'a', 'Z', '0', '9', '.', ':', '-', '_', '%', '/', '[', ']', '"', '\\', '\n', '\r', '\t', ' ', '{',
        '}', '<', '>', '&', '=', ',', '#', '\u{1b}', '\u{85}', '\u{2028}', 'é',
    ]);
    prop_oneof![
        prop::collection::vec(nasty, 0..24).prop_map(|v| v.into_iter().collect::<String>()),
        any::<Vec<u8>>().prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        "[a-z0-9.-]{1,20}:[0-9]{1,5}",
    ]
}

/// A cycle report of one pool whose members are `names`, as the controller fills it.
fn report_of(names: &[String]) -> llm_load_controller::report::CycleReport {
    use llm_load_controller::report::{CycleReport, MemberReport, PoolReport};
    let members = names
        .iter()
        .enumerate()
        .map(|(i, n)| MemberReport { member: n.clone(), ratio: 1 + i as u32, ..Default::default() })
        .collect();
    CycleReport {
        ts: "2026-12-06T00:00:00Z".into(),
        pools: vec![PoolReport { pool: "p".into(), members, ..Default::default() }],
    }
}

/// The controller's exposition with one weight series per name.
fn page_of(names: &[String]) -> String {
    use llm_load_controller::telemetry::{labels, Telemetry};
    let t = Telemetry::new(Duration::from_secs(1), 3);
    let m = &t.metrics;
    for (i, n) in names.iter().enumerate() {
        m.member_ratio.get_or_create(&labels(&[("pool", "p"), ("member", n)])).set(i as f64);
    }
    m.encode()
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 300,
        rng_seed: proptest::test_runner::RngSeed::Fixed(27),
        failure_persistence: None,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Whatever a name holds, even one that skipped the check (defence in depth): the exposition
    /// has one line per series and gives the name back, the sideband feed has one line per valid
    /// member, the table one line per member, the JSON round-trips; and a name that passes the
    /// check holds nothing that any output treats as syntax.
    #[test]
    fn no_name_changes_the_shape_of_an_output(names in proptest::collection::btree_set(hostile_name(), 0..8)) {
        let names: Vec<String> = names.into_iter().collect();
        for n in &names {
            if llm_lc_adapters::name::check(n).is_ok() {
                proptest::prop_assert!(!n.chars().any(|c| c.is_control() || "\"\\ {}<>&=,#'".contains(c)), "{n:?}");
            }
            proptest::prop_assert!(llm_lc_adapters::name::escape_name(n).chars().all(|c| c.is_ascii_graphic()));
        }

        let page = page_of(&names);
        let plain: Vec<String> = (0..names.len()).map(|i| format!("m{i}:1")).collect();
        proptest::prop_assert_eq!(page.lines().count(), page_of(&plain).lines().count(), "{}", page);
        let weights = page.lines().filter(|l| l.starts_with("llmlc_member_weight{")).count();
        proptest::prop_assert_eq!(weights, names.len());
        let back: BTreeSet<String> = label_values(&page, "member");
        proptest::prop_assert_eq!(back, names.iter().cloned().collect::<BTreeSet<_>>());

        let report = report_of(&names);
        let feed = llm_load_controller::telemetry::sideband::pool_text(&report, "p").expect("pool");
        let valid = names.iter().filter(|n| llm_lc_adapters::name::is_host_port(n)).count();
        let lines: Vec<&str> = feed.lines().collect();
        proptest::prop_assert_eq!(lines.len(), 1 + valid, "{}", feed);
        proptest::prop_assert!(lines[1..].iter().all(|l| l.split(' ').count() == 3), "{}", feed);

        let table = report.to_table();
        proptest::prop_assert_eq!(table.lines().count(), 2 + names.len(), "{}", table);

        // Static config: a name is a strict host:port or the file is refused, the place named.
        for n in &names {
            let doc = serde_json::json!({
                "sources": {"direct": {"kind": "scrape"}},
                "pools": [{"name": "p", "source": "direct", "members": {"static": [n]}}],
            });
            match llm_load_controller::config::parse(std::path::Path::new("c.yaml"), &doc.to_string()) {
                Ok(_) => proptest::prop_assert!(llm_lc_adapters::name::is_host_port(n), "accepted {:?}", n),
                // Refused by the field check, or before it by the YAML reader (control characters).
                Err(e) => {
                    let e = e.to_string();
                    proptest::prop_assert!(e.contains("pools[0].members.static[0]") || e.starts_with("c.yaml:1:"), "{}", e)
                }
            }
        }

        let json: Value = serde_json::from_str(&serde_json::to_string(&report).expect("serializes")).expect("parses");
        let members: Vec<&str> = json["pools"][0]["members"].as_array().expect("members").iter().filter_map(|m| m["member"].as_str()).collect();
        proptest::prop_assert_eq!(members, names.iter().map(String::as_str).collect::<Vec<_>>());
    }
}

/// promtool, which parses as Prometheus does, on one page of 300 seeded random hostile names:
/// nothing but the OpenMetrics-vs-classic HELP lint, and one sample per name.
#[test]
fn promtool_parses_a_page_of_hostile_names() {
    use proptest::strategy::{Strategy, ValueTree};
    let mut runner = proptest::test_runner::TestRunner::new_with_rng(
        Default::default(),
        proptest::test_runner::TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &[27; 32]),
    );
    let names: BTreeSet<String> =
        (0..300).map(|_| hostile_name().new_tree(&mut runner).expect("a name").current()).collect();
    let names: Vec<String> = names.into_iter().collect();
    let page = page_of(&names);
    let (_, said) = promtool_check(&page);
    for line in said.lines().filter(|l| !l.trim().is_empty()) {
        let family = line.strip_suffix("_total no help text");
        assert!(family.is_some_and(|f| page.contains(&format!("# HELP {f} "))), "promtool: {line:?}\n{said}");
    }
    let weights = page.lines().filter(|l| l.starts_with("llmlc_member_weight{")).count();
    assert_eq!(weights, names.len());
}

/// What each entry of outside names makes of `names`: the members it hands to the controller, before
/// the door (`controller::admit`). Each builds the wire text the entry reads, with the name where
/// the outside puts it, and parses it with the entry's own code.
fn through_entries(names: &[String]) -> Vec<(&'static str, Vec<llm_lc_adapters::MemberId>)> {
    use serde_json::json;
    let mut out = Vec::new();

    // Prometheus `up{selector}`: the `instance` label of each target, through the HTTP client and
    // the join, from a Prometheus stand-in that answers what a real one would for such labels.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let discovered = rt.block_on(async {
        let server = wiremock::MockServer::start().await;
        let result: Vec<Value> = names
            .iter()
            .map(|n| json!({"metric": {"__name__": "up", "job": "vllm", "instance": n}, "value": [1.7e9, "1"]}))
            .collect();
        wiremock::Mock::given(wiremock::matchers::path("/api/v1/query"))
            .respond_with(wiremock::ResponseTemplate::new(200).set_body_json(
                json!({"status": "success", "data": {"resultType": "vector", "result": result}}),
            ))
            .mount(&server)
            .await;
        let cfg: llm_load_controller::source::config::PrometheusConfig =
            serde_json::from_value(json!({"url": server.uri()})).expect("prometheus config");
        let source = llm_load_controller::source::prometheus::PrometheusSource::new("prom", &cfg).expect("source");
        let join = llm_load_controller::source::Join::new(&Default::default()).expect("join");
        source.discover("{job=\"vllm\"}", &join).await.expect("discover")
    });
    out.push(("prometheus", discovered));

    // EndpointSlices: each name as an endpoint address of an IPv4 slice, port 8000.
    let slice = json!({
        "addressType": "IPv4",
        "endpoints": names.iter().map(|n| json!({"addresses": [n], "conditions": {"ready": true}})).collect::<Vec<_>>(),
        "ports": [{"name": "http", "port": 8000}],
    });
    let slices: Vec<llm_load_controller::source::kubernetes::Slice> =
        vec![serde_json::from_value(slice).expect("slice")];
    out.push((
        "endpointslices",
        llm_load_controller::source::kubernetes::ready_members(&slices, None, "vllm").expect("members"),
    ));

    // HAProxy `show servers state`: each name as a server's address and FQDN (the reply of a
    // `server-template` whose resolver answered it).
    let mut reply = String::from(
        "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight \
         srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state \
         srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord\n",
    );
    for (i, n) in names.iter().enumerate() {
        reply.push_str(&format!("3 llm {i} s{i} {n} 2 0 1 1 4 1 0 2 0 0 0 0 {n} 8000 -\n"));
    }
    let haproxy = llm_lc_adapters::haproxy::state::parse_servers_state(&reply)
        .map(|servers| servers.iter().filter_map(|s| s.member_id()).collect())
        .unwrap_or_default();
    out.push(("haproxy", haproxy));

    // BIG-IP pool members: each name as the member's name and address.
    out.push((
        "bigip",
        names.iter().map(|n| llm_lc_adapters::f5::member_id_of(&format!("{n}:8000"), n)).collect(),
    ));

    // Envoy admin `/clusters?format=json`: each name as a host's socket address.
    let clusters = json!({"cluster_statuses": [{"name": "vllm", "host_statuses": names.iter().map(|n| json!({
        "address": {"socket_address": {"address": n, "port_value": 8000}}
    })).collect::<Vec<_>>()}]});
    let envoy = llm_lc_adapters::envoy::admin::members_of(clusters.to_string().as_bytes(), "vllm")
        .expect("parses")
        .unwrap_or_default();
    out.push(("envoy", envoy));
    out
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 100,
        rng_seed: proptest::test_runner::RngSeed::Fixed(28),
        failure_persistence: None,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Arbitrary names through every entry (Prometheus labels, EndpointSlices, HAProxy's and
    /// BIG-IP's pools, Envoy's clusters; static config and `--scrape` lists are the test above),
    /// then the door, then the outputs: a member is admitted only as what the outside carried (no
    /// fragment of a name becomes a member of its own), every refused one is counted without its
    /// name, and the exposition, sideband feed, table and JSON keep one record per member.
    #[test]
    fn every_entry_admits_only_checked_names_and_the_outputs_keep_their_shape(
        names in proptest::collection::btree_set(hostile_name(), 0..6)
    ) {
        use llm_load_controller::telemetry::{labels, Telemetry};
        let names: Vec<String> = names.into_iter().collect();
        for (entry, found) in through_entries(&names) {
            let t = Telemetry::new(Duration::from_secs(1), 3);
            let offered = found.len();
            let (admitted, refused) = llm_load_controller::controller::admit("p", found, &t, &Default::default());
            // Refused names are a set (a name offered twice is one refusal), counted per offer.
            proptest::prop_assert!(admitted.len() + refused.len() <= offered, "{}", entry);
            for m in &admitted {
                proptest::prop_assert!(llm_lc_adapters::name::check(m.as_str()).is_ok(), "{entry}: {m:?}");
                // What the outside carried, as the entry spells it (`[v6]:port`, `ip:port`, a name).
                let carried = names.iter().any(|n| {
                    let s = m.as_str();
                    s == n || s == format!("{n}:8000") || s.strip_suffix(":8000").is_some_and(|h| {
                        h.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>().ok()
                            == n.parse::<std::net::IpAddr>().ok() && n.parse::<std::net::IpAddr>().is_ok()
                    })
                });
                proptest::prop_assert!(carried, "{}: {:?} was not offered as such ({:?})", entry, m, names);
            }
            let invalid: f64 = t.metrics.encode().lines()
                .filter(|l| l.starts_with("llmlc_member_errors_total{") && l.contains("reason=\"invalid_name\""))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            proptest::prop_assert_eq!(invalid as usize, offered - admitted.len(), "{}", entry);

            let shown: Vec<String> = admitted.iter().map(|m| m.as_str().to_string()).collect();
            for (i, m) in shown.iter().enumerate() {
                t.metrics.member_ratio.get_or_create(&labels(&[("pool", "p"), ("member", m)])).set(i as f64);
            }
            let page = t.metrics.encode();
            proptest::prop_assert_eq!(label_values(&page, "member"), shown.iter().cloned().collect::<BTreeSet<_>>(), "{}", entry);
            let weights = page.lines().filter(|l| l.starts_with("llmlc_member_weight{")).count();
            proptest::prop_assert_eq!(weights, shown.len(), "{}", entry);
            let report = report_of(&shown);
            let feed = llm_load_controller::telemetry::sideband::pool_text(&report, "p").expect("pool");
            let valid = shown.iter().filter(|n| llm_lc_adapters::name::is_host_port(n)).count();
            proptest::prop_assert_eq!(feed.lines().count(), 1 + valid, "{}: {}", entry, feed);
            proptest::prop_assert_eq!(report.to_table().lines().count(), 2 + shown.len(), "{}", entry);
            let json: Value = serde_json::from_str(&serde_json::to_string(&report).expect("serializes")).expect("parses");
            proptest::prop_assert_eq!(json["pools"][0]["members"].as_array().map(Vec::len), Some(shown.len()));
        }
    }
}
