//! `check` without `--offline`: can this machine reach what the config names?
//!
//! One connection per address (name resolution included), all at once, each with its own
//! deadline: a TCP connect for URLs and `host:port`, a connect to the socket for `unix:` paths.
//! Nothing is sent and no credential is read, so a check never logs in, never counts as a failed
//! login on BIG-IP and never changes anything. What the config does not name (members discovered
//! at run time, Envoy, which polls the controller) is listed as not reachable from here by design.
//! A connection proves the path and the port, not that the thing behind it answers correctly.

use std::time::Duration;

use llm_lc_adapters::haproxy::HaproxyMode;
use llm_lc_adapters::name::escape_controls;
use llm_lc_adapters::sink::SinkConfig;

use crate::config::Config;
use crate::source::config::SourceConfig;

/// How long each connection may take.
pub const TIMEOUT: Duration = Duration::from_secs(2);

/// Something the config names and the controller would connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// What it is, for the report: `source prom`, `pool llm: member 10.0.0.1:8000`, ...
    pub what: String,
    pub addr: Addr,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Addr {
    /// `host:port`, resolved when probed.
    Tcp(String),
    Unix(String),
    /// Named in a form this check cannot probe; the reason.
    Unprobed(String),
}

impl std::fmt::Display for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Addr::Tcp(a) => write!(f, "{a}"),
            Addr::Unix(p) => write!(f, "unix:{p}"),
            Addr::Unprobed(why) => write!(f, "({why})"),
        }
    }
}

/// `host:port` of a URL (the scheme's port when it names none).
fn url_addr(url: &str) -> Addr {
    match reqwest::Url::parse(url) {
        Ok(u) => match (u.host_str(), u.port_or_known_default()) {
            // An IPv6 host comes back in its brackets already.
            (Some(h), Some(p)) => Addr::Tcp(format!("{h}:{p}")),
            _ => Addr::Unprobed(format!("no host and port in {url:?}")),
        },
        Err(e) => Addr::Unprobed(format!("not a URL: {e}")),
    }
}

/// A HAProxy runtime address: `unix:/path` or `host:port`.
fn runtime_addr(a: &str) -> Addr {
    match a.strip_prefix("unix:") {
        Some(p) => Addr::Unix(p.to_string()),
        None => Addr::Tcp(a.to_string()),
    }
}

/// Everything the config names that the running controller would connect to, in config order.
pub fn targets(cfg: &Config) -> Vec<Target> {
    let mut out = Vec::new();
    let mut push = |what: String, addr: Addr| out.push(Target { what, addr });
    for (name, s) in &cfg.sources {
        if let SourceConfig::Prometheus(p) = s {
            push(format!("source {name}"), url_addr(&p.url));
        }
    }
    for p in &cfg.pools {
        let scraped = matches!(cfg.sources.get(&p.source), Some(SourceConfig::Scrape(_)));
        if scraped {
            for m in p.members.static_list.iter().flatten() {
                push(format!("pool {}: member", p.name), Addr::Tcp(m.as_str().to_string()));
            }
        }
        let sink = format!("pool {}: sink {}", p.name, p.sink.kind());
        match &p.sink {
            SinkConfig::DryRun => {}
            SinkConfig::Webhook(w) => push(sink, url_addr(&w.url)),
            SinkConfig::F5(f) => {
                for u in std::iter::once(&f.url).filter(|u| !u.is_empty()).chain(&f.urls) {
                    push(sink.clone(), url_addr(u));
                }
            }
            SinkConfig::Haproxy(h) => {
                for a in h.address.iter().chain(&h.addresses) {
                    push(sink.clone(), runtime_addr(a));
                }
                if h.mode == HaproxyMode::Agent {
                    push(
                        sink.clone(),
                        Addr::Unprobed("agent mode: HAProxy connects to the controller".into()),
                    );
                }
            }
            SinkConfig::Envoy(_) => {
                push(sink, Addr::Unprobed("Envoy polls the controller; nothing to reach".into()))
            }
        }
    }
    out
}

/// Connect to one address within [`TIMEOUT`]: `Ok` or why not.
async fn probe(addr: &Addr) -> Result<(), String> {
    let attempt = async {
        match addr {
            Addr::Tcp(a) => tokio::net::TcpStream::connect(a.as_str()).await.map(drop),
            #[cfg(unix)]
            Addr::Unix(p) => tokio::net::UnixStream::connect(p).await.map(drop),
            #[cfg(not(unix))]
            Addr::Unix(_) => Err(std::io::Error::other("unix sockets need a unix system")),
            Addr::Unprobed(_) => Ok(()),
        }
    };
    match tokio::time::timeout(TIMEOUT, attempt).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no connection within {TIMEOUT:?}")),
    }
}

/// Probe every target at once; the report as YAML comment lines (so the plan above them still
/// parses), and how many could not be reached.
pub async fn report(targets: &[Target]) -> (String, usize) {
    let results = futures::future::join_all(targets.iter().map(|t| probe(&t.addr))).await;
    let probed = targets.iter().filter(|t| !matches!(t.addr, Addr::Unprobed(_))).count();
    let mut failed = 0;
    let mut lines = Vec::new();
    for (t, r) in targets.iter().zip(results) {
        let what = escape_controls(&t.what);
        lines.push(match (&t.addr, r) {
            (Addr::Unprobed(_), _) => format!("#   not probed   {what} {}", t.addr),
            (_, Ok(())) => format!("#   reachable    {what} {}", t.addr),
            (_, Err(e)) => {
                failed += 1;
                format!("#   UNREACHABLE  {what} {}: {}", t.addr, escape_controls(&e))
            }
        });
    }
    let head = format!("# reach: {} of {probed} reachable from here\n", probed - failed);
    (head + &lines.join("\n") + if lines.is_empty() { "" } else { "\n" }, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_runtime_addresses_become_host_and_port() {
        assert_eq!(url_addr("https://bigip.example.com"), Addr::Tcp("bigip.example.com:443".into()));
        assert_eq!(url_addr("http://10.0.0.5:9090/x"), Addr::Tcp("10.0.0.5:9090".into()));
        assert_eq!(url_addr("https://[::1]:8443"), Addr::Tcp("[::1]:8443".into()));
        assert!(matches!(url_addr("not a url"), Addr::Unprobed(_)));
        assert_eq!(runtime_addr("unix:/run/haproxy.sock"), Addr::Unix("/run/haproxy.sock".into()));
        assert_eq!(runtime_addr("127.0.0.1:9999"), Addr::Tcp("127.0.0.1:9999".into()));
    }

    #[tokio::test]
    async fn the_report_names_each_unreachable_thing() {
        let live = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let (live_a, dead_a) = (live.local_addr().expect("addr"), dead.local_addr().expect("addr"));
        drop(dead);
        let t = |what: &str, addr: Addr| Target { what: what.into(), addr };
        let (text, failed) = report(&[
            t("source prom", Addr::Tcp(live_a.to_string())),
            t("pool llm: sink f5", Addr::Tcp(dead_a.to_string())),
            t("pool llm: sink haproxy", Addr::Unix("/nonexistent/llmlc-test.sock".into())),
            t("pool e: sink envoy", Addr::Unprobed("Envoy polls the controller".into())),
        ])
        .await;
        assert_eq!(failed, 2, "{text}");
        assert!(text.starts_with("# reach: 1 of 3 reachable from here\n"), "{text}");
        assert!(text.contains(&format!("#   reachable    source prom {live_a}")), "{text}");
        assert!(text.contains(&format!("#   UNREACHABLE  pool llm: sink f5 {dead_a}: ")), "{text}");
        assert!(
            text.contains("#   UNREACHABLE  pool llm: sink haproxy unix:/nonexistent/llmlc-test.sock: "),
            "{text}"
        );
        assert!(text.contains("#   not probed   pool e: sink envoy (Envoy polls the controller)"), "{text}");
        assert!(text.lines().all(|l| l.starts_with('#')), "comments only: {text}");
    }
}
