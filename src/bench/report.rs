//! Human tables (text and markdown) of benchmark results; JSON is the serde form of
//! [`ScenarioReport`].

use std::fmt::Write;

use super::fleet::BalancerResult;
use super::ScenarioReport;

/// Seconds as a short human value: `85ms`, `1.24s`, `>=60s` for a censored timeout.
fn secs(v: f64, timeout: Option<f64>) -> String {
    if v.is_nan() {
        return "-".into();
    }
    let censored = timeout.is_some_and(|t| v >= t - 1e-6);
    let s = if v < 1.0 { format!("{:.0}ms", v * 1000.0) } else { format!("{v:.2}s") };
    if censored {
        format!(">={s}")
    } else {
        s
    }
}

fn header(r: &ScenarioReport) -> String {
    format!(
        "scenario {} at {:.0}% load: {} replicas (speeds {}{}), {:.1} req/s offered of {:.1} req/s capacity, {} policy{}, \
         {} samples every {}s, pushes every {}s; measured {:.0}s after {:.0}s warm-up; seed {}\n",
        r.scenario,
        r.load * 100.0,
        r.replicas,
        r.speeds.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>().join("/"),
        if r.kv_scale.iter().all(|&k| k == 1.0) {
            String::new()
        } else {
            format!("; KV {}", r.kv_scale.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>().join("/"))
        } + &if r.max_num_seqs.is_empty() {
            String::new()
        } else {
            let limits: Vec<String> =
                r.max_num_seqs.iter().map(|m| m.map_or("-".to_string(), |m| m.to_string())).collect();
            format!("; batch limits {}", limits.join("/"))
        },
        r.arrival_rps,
        r.capacity_rps,
        r.policy,
        if r.policy_params.is_empty() && r.picker_params.is_empty() {
            String::new()
        } else {
            format!(" ({})", r.policy_params.iter().chain(&r.picker_params).cloned().collect::<Vec<_>>().join(", "))
        },
        r.signals.source,
        r.signals.scrape_interval_s,
        r.signals.push_interval_s,
        r.duration_s - r.warmup_s,
        r.warmup_s,
        r.seed
    )
}

const COLUMNS: &[&str] = &[
    "balancer",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "ITL p50",
    "ITL p99",
    "E2E p99",
    "tok/s",
    "completed",
    "rejected",
    "KV spread",
    "queue spread",
    "weights",
];

/// The columns of a scenario: the hit rate only where prompts share prefixes, so the tables of
/// every other scenario read as they always have.
fn columns(r: &ScenarioReport) -> Vec<&'static str> {
    let mut c = COLUMNS.to_vec();
    if has_hits(r) {
        c.insert(c.len() - 1, "prefix hits");
    }
    c
}

fn has_hits(r: &ScenarioReport) -> bool {
    r.results.iter().any(|b| b.prefix_hit_rate > 0.0)
}

fn row(b: &BalancerResult, timeout: f64, hits: bool) -> Vec<String> {
    let mut cells = row_cells(b, timeout);
    if hits {
        cells.insert(cells.len() - 1, format!("{:.1}%", 100.0 * b.prefix_hit_rate));
    }
    cells
}

fn row_cells(b: &BalancerResult, timeout: f64) -> Vec<String> {
    vec![
        b.balancer.clone(),
        secs(b.ttft_p50_s, Some(timeout)),
        secs(b.ttft_p90_s, Some(timeout)),
        secs(b.ttft_p99_s, Some(timeout)),
        secs(b.itl_p50_s, None),
        secs(b.itl_p99_s, None),
        secs(b.e2e_p99_s, None),
        format!("{:.0}", b.throughput_tok_s),
        b.completed.to_string(),
        b.rejected.to_string(),
        format!("{:.3}", b.kv_spread),
        format!("{:.1}", b.queue_spread),
        if b.final_weights.is_empty() {
            "-".into()
        } else {
            b.final_weights.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(":")
        },
    ]
}

/// Aligned plain-text table.
pub fn text(r: &ScenarioReport) -> String {
    let rows: Vec<Vec<String>> = r.results.iter().map(|b| row(b, timeout_of(r), has_hits(r))).collect();
    let columns = columns(r);
    let mut widths: Vec<usize> = columns.iter().map(|c| c.len()).collect();
    for row in &rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = header(r);
    let line = |cells: &[String]| -> String {
        cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| if i == 0 { format!("{c:<w$}") } else { format!("{c:>w$}") })
            .collect::<Vec<_>>()
            .join("  ")
    };
    let head: Vec<String> = columns.iter().map(|c| c.to_string()).collect();
    let _ = writeln!(out, "{}", line(&head));
    for row in &rows {
        let _ = writeln!(out, "{}", line(row));
    }
    out
}

/// TTFTs at the clients' timeout are shown as `>=`: they include clients that gave up.
fn timeout_of(r: &ScenarioReport) -> f64 {
    r.timeout_s
}

/// Markdown table of one scenario.
pub fn markdown(r: &ScenarioReport) -> String {
    let mut out = format!("{}\n", header(r));
    let columns = columns(r);
    let _ = writeln!(out, "| {} |", columns.join(" | "));
    let _ = writeln!(out, "|{}", "---|".repeat(columns.len()));
    for b in &r.results {
        let _ = writeln!(out, "| {} |", row(b, timeout_of(r), has_hits(r)).join(" | "));
    }
    out
}

/// One compact table for a sweep: a row per scenario and load, p99 TTFT per balancer, then the
/// ratio balancers' ratio to round-robin and to epp.
pub fn sweep_markdown(reports: &[ScenarioReport]) -> String {
    let Some(first) = reports.first() else { return String::new() };
    let names: Vec<&str> = first.results.iter().map(|b| b.balancer.as_str()).collect();
    let mut out = String::new();
    let _ = writeln!(out, "p99 TTFT (rejected requests in brackets when any):\n");
    let _ = writeln!(out, "| scenario | load | {} |", names.join(" | "));
    let _ = writeln!(out, "|---|---|{}", "---|".repeat(names.len()));
    for r in reports {
        let cells: Vec<String> = names
            .iter()
            .map(|n| match r.results.iter().find(|b| b.balancer == *n) {
                Some(b) if b.rejected > 0 => {
                    format!("{} ({})", secs(b.ttft_p99_s, Some(r.timeout_s)), b.rejected)
                }
                Some(b) => secs(b.ttft_p99_s, Some(r.timeout_s)),
                None => "-".into(),
            })
            .collect();
        let _ = writeln!(out, "| {} | {:.0}% | {} |", r.scenario, r.load * 100.0, cells.join(" | "));
    }
    let find = |r: &ScenarioReport, n: &str| r.results.iter().find(|b| b.balancer == n).map(|b| b.ttft_p99_s);
    let ratio_names: Vec<&str> = names.iter().copied().filter(|n| n.starts_with("ratio")).collect();
    if !ratio_names.is_empty() && names.contains(&"round-robin") {
        let _ = writeln!(
            out,
            "\np99 TTFT of the ratio balancers relative to round-robin / to epp (lower is better):\n"
        );
        let _ = writeln!(out, "| scenario | load | {} |", ratio_names.join(" | "));
        let _ = writeln!(out, "|---|---|{}", "---|".repeat(ratio_names.len()));
        for r in reports {
            let rr = find(r, "round-robin");
            let epp = find(r, "epp");
            let cells: Vec<String> = ratio_names
                .iter()
                .map(|n| {
                    let v = find(r, n);
                    let rel = |base: Option<f64>| match (v, base) {
                        (Some(v), Some(b)) if b > 0.0 && v / b < 0.01 => "<0.01x".to_string(),
                        (Some(v), Some(b)) if b > 0.0 => format!("{:.2}x", v / b),
                        _ => "-".into(),
                    };
                    format!("{} / {}", rel(rr), rel(epp))
                })
                .collect();
            let _ = writeln!(out, "| {} | {:.0}% | {} |", r.scenario, r.load * 100.0, cells.join(" | "));
        }
    }
    let _ = writeln!(out, "\nKV spread (time-average of max-min KV usage across replicas):\n");
    let _ = writeln!(out, "| scenario | load | {} |", names.join(" | "));
    let _ = writeln!(out, "|---|---|{}", "---|".repeat(names.len()));
    for r in reports {
        let cells: Vec<String> = names
            .iter()
            .map(|n| {
                r.results
                    .iter()
                    .find(|b| b.balancer == *n)
                    .map(|b| format!("{:.3}", b.kv_spread))
                    .unwrap_or_default()
            })
            .collect();
        let _ = writeln!(out, "| {} | {:.0}% | {} |", r.scenario, r.load * 100.0, cells.join(" | "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_short_and_censored_values_marked() {
        assert_eq!(secs(0.0854, None), "85ms");
        assert_eq!(secs(1.234, None), "1.23s");
        assert_eq!(secs(60.0, Some(60.0)), ">=60.00s");
        assert_eq!(secs(f64::NAN, None), "-");
    }
}
