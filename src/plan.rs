//! The resolved plan `check` prints: for each pool, where its members come from, the exact queries
//! or metric names it reads, the policy and the sink. What you read here is what `run` will do.

use std::fmt::Write as _;

use crate::config::{Config, SourceConfig};
use crate::source::profile::promql;
use crate::source::redact_url;
use crate::source::validate::redact_urls_in;

pub fn describe(cfg: &Config) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "config OK: {} source(s), {} pool(s), cycle every {}, listening on {}",
        cfg.sources.len(),
        cfg.pools.len(),
        humantime::format_duration(cfg.interval),
        cfg.listen
    );
    for (name, src) in &cfg.sources {
        match src {
            SourceConfig::Prometheus(p) => {
                let _ = writeln!(
                    s,
                    "source {name}: prometheus {} (timeout {}, token: {}, CA: {}, TLS verify: {})",
                    redact_url(&p.url),
                    humantime::format_duration(p.timeout),
                    p.bearer_token.as_ref().map(|t| format!("{t:?}")).unwrap_or_else(|| "none".into()),
                    p.ca_file.as_ref().map(|c| c.display().to_string()).unwrap_or_else(|| "system".into()),
                    if p.insecure_skip_verify { "OFF" } else { "on" }
                );
            }
            SourceConfig::Scrape(sc) => {
                let _ = writeln!(
                    s,
                    "source {name}: direct scrape {}://MEMBER{} (timeout {}, at most {} at once)",
                    sc.scheme,
                    sc.path,
                    humantime::format_duration(sc.timeout),
                    sc.concurrency
                );
            }
        }
    }
    for p in &cfg.pools {
        let _ = writeln!(s, "\npool {}", p.name);
        let _ = writeln!(s, "  source:  {} (profile {:?})", p.source, p.profile);
        if let Some(list) = &p.members.static_list {
            let _ = writeln!(
                s,
                "  members: {}",
                list.iter().map(|m| m.to_string()).collect::<Vec<_>>().join(", ")
            );
        }
        if let Some(sel) = &p.members.prometheus_up {
            let _ = writeln!(
                s,
                "  members: discovered each cycle from up{sel}, joined by label {:?}",
                p.join.label
            );
        }
        if p.members.from_lb {
            let _ = writeln!(s, "  members: read each cycle from the {} sink's pool", p.sink.kind());
        }
        if let Some(re) = &p.join.regex {
            let _ = writeln!(
                s,
                "  join:    {} =~ {re} -> {}",
                p.join.label,
                p.join.replacement.as_deref().unwrap_or("$1")
            );
        }
        let names = p.profile.resolve(&p.metrics);
        match cfg.sources.get(&p.source) {
            Some(SourceConfig::Prometheus(pc)) => {
                for (signal, q) in
                    promql(&names, &p.queries, &p.join.label, p.selector.as_deref(), pc.rate_window)
                {
                    let _ = writeln!(s, "  query {:<9} {q}", signal.as_str());
                }
            }
            _ => {
                let _ = writeln!(
                    s,
                    "  metrics: waiting={:?} running={:?} kv_usage={:?} latency={:?}",
                    names.waiting, names.running, names.kv_usage, names.latency_histogram
                );
            }
        }
        let _ = writeln!(s, "  policy:  {:?}", p.policy);
        let _ = writeln!(
            s,
            "  ratios:  {}..{}, stale after {}, hold {} then pool mean, on_stale {:?} after {}",
            p.ratio.min,
            p.ratio.max,
            humantime::format_duration(p.stale_after),
            humantime::format_duration(p.grace),
            p.on_stale,
            humantime::format_duration(p.reset_after)
        );
        // Sink settings may hold URLs with credentials (a webhook's, say).
        let _ = writeln!(s, "  sink:    {}", redact_urls_in(&format!("{:?}", p.sink)));
    }
    s
}
