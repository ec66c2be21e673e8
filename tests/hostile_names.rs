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
