//! The goals grid of issue 16 and its table: which points are run, and whether the controller's two
//! modes meet their goals there, as medians (and ranges) of p99 TTFT over several seeds.
//!
//! A goal compares medians over seeds: `ratio-least-request` p99 / `least-request` p99 is the
//! median of the former over the median of the latter; the range beside it is the spread of the
//! per-seed quotients (same seed, same requests, so a per-seed quotient is a paired comparison).

use std::fmt::Write as _;

use super::scenario::GRID;
use super::ScenarioReport;

/// Load of the goals grid, and the extra points: tp-mixed near saturation, many LB instances.
pub const LOAD: f64 = 0.85;
pub const EXTRA: &[(&str, f64, usize)] = &[("tp-mixed", 0.95, 1), ("mixed-memory", 0.85, 32)];
/// Where the ratios must halve least-request's p99 (scenario, LB instances).
pub const MUST_HALVE: &[(&str, usize)] =
    &[("mixed-memory", 1), ("mem-only", 1), ("shared-backends", 1), ("mixed-memory", 32)];

/// The points (scenario, load, LB instances) of the goals grid and of the picker's goals
/// ([`super::picker_goals::POINTS`]), restricted to `only` when given.
pub fn points(only: &[String]) -> Vec<(String, f64, usize)> {
    let mut v: Vec<(String, f64, usize)> = GRID.iter().map(|s| (s.to_string(), LOAD, 1)).collect();
    v.extend(EXTRA.iter().map(|&(s, l, k)| (s.to_string(), l, k)));
    v.extend(super::picker_goals::POINTS.iter().map(|&(s, l, k)| (s.to_string(), l, k)));
    if !only.is_empty() {
        v.retain(|(s, _, _)| only.iter().any(|o| o == s));
    }
    v
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// Per-seed p99 TTFT of one balancer at one point.
fn p99s(group: &[&ScenarioReport], balancer: &str) -> Vec<f64> {
    group
        .iter()
        .filter_map(|r| r.results.iter().find(|b| b.balancer == balancer).map(|b| b.ttft_p99_s))
        .collect()
}

/// Median over seeds and (min, max).
pub fn summary(values: &[f64]) -> Option<(f64, f64, f64)> {
    let mut v = values.to_vec();
    let m = median(&mut v)?;
    Some((m, v[0], v[v.len() - 1]))
}

/// Median quotient of medians `a / b`, and the range of per-seed quotients.
pub fn quotient(group: &[&ScenarioReport], a: &str, b: &str) -> Option<(f64, f64, f64)> {
    let (va, vb) = (p99s(group, a), p99s(group, b));
    if va.len() != vb.len() || va.is_empty() {
        return None;
    }
    let (ma, mb) = (summary(&va)?.0, summary(&vb)?.0);
    let per: Vec<f64> = va.iter().zip(&vb).map(|(x, y)| x / y.max(1e-9)).collect();
    let (_, lo, hi) = summary(&per)?;
    Some((ma / mb.max(1e-9), lo, hi))
}

fn secs(v: f64) -> String {
    if v < 1.0 {
        format!("{:.0}ms", v * 1000.0)
    } else {
        format!("{v:.2}s")
    }
}

fn label(r: &ScenarioReport) -> String {
    let mut s = format!("{} {:.0}%", r.scenario, r.load * 100.0);
    if r.lb_instances > 1 {
        let _ = write!(s, " x{} LB", r.lb_instances);
    }
    s
}

/// Reports grouped by point (scenario, load, instances), in first-seen order.
pub fn groups(reports: &[ScenarioReport]) -> Vec<Vec<&ScenarioReport>> {
    let mut out: Vec<Vec<&ScenarioReport>> = Vec::new();
    for r in reports {
        let key = (&r.scenario, r.load.to_bits(), r.lb_instances);
        match out.iter_mut().find(|g| (&g[0].scenario, g[0].load.to_bits(), g[0].lb_instances) == key) {
            Some(g) => g.push(r),
            None => out.push(vec![r]),
        }
    }
    out
}

/// One goal check at one point: the quotient, its limit, and whether it holds.
struct Check {
    q: Option<(f64, f64, f64)>,
    limit: f64,
    /// `true`: must be strictly below the limit.
    strict: bool,
}

impl Check {
    fn cell(&self) -> String {
        match self.q {
            None => "-".into(),
            Some((m, lo, hi)) => {
                let ok = if self.strict { m < self.limit } else { m <= self.limit };
                format!("{}{m:.2}x ({lo:.2}-{hi:.2})", if ok { "" } else { "**FAIL** " })
            }
        }
    }

    fn met(&self) -> Option<bool> {
        self.q.map(|(m, _, _)| if self.strict { m < self.limit } else { m <= self.limit })
    }
}

/// The goals table: p99 TTFT medians [ranges] per balancer, then each goal's quotient per point.
pub fn markdown(reports: &[ScenarioReport]) -> String {
    let groups = groups(reports);
    let Some(first) = groups.first().and_then(|g| g.first()) else { return String::new() };
    let names: Vec<&str> = first.results.iter().map(|b| b.balancer.as_str()).collect();
    let mut seeds: Vec<u64> = reports.iter().map(|r| r.seed).collect();
    seeds.sort_unstable();
    seeds.dedup();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "p99 TTFT, median over seeds {seeds:?} [min-max] (policy {} {:?}):\n",
        first.policy, first.policy_params
    );
    let _ = writeln!(out, "| point | {} |", names.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|".repeat(names.len()));
    for g in &groups {
        let cells: Vec<String> = names
            .iter()
            .map(|n| match summary(&p99s(g, n)) {
                Some((m, lo, hi)) => format!("{} [{}-{}]", secs(m), secs(lo), secs(hi)),
                None => "-".into(),
            })
            .collect();
        let _ = writeln!(out, "| {} | {} |", label(g[0]), cells.join(" | "));
    }
    let _ = writeln!(
        out,
        "\nGoals: median quotient of p99 TTFT (range of per-seed quotients); **FAIL** marks a missed goal.\n"
    );
    let _ = writeln!(
        out,
        "| point | ratio-least-request / least-request (<= 1.10, <= 0.5 where marked) | ratio-least-request / epp-active (<= 1.25) | ratio / static-ratio (< 1 on slow-drift, <= 1.5 elsewhere) |"
    );
    let _ = writeln!(out, "|---|---|---|---|");
    let (mut met, mut total) = (0, 0);
    for g in &groups {
        let r = g[0];
        if super::picker_goals::POINTS.contains(&(r.scenario.as_str(), r.load, r.lb_instances)) {
            continue;
        }
        let halve = MUST_HALVE.iter().any(|&(s, k)| s == r.scenario && k == r.lb_instances);
        let checks = [
            Check {
                q: quotient(g, "ratio-least-request", "least-request"),
                limit: if halve { 0.5 } else { 1.10 },
                strict: false,
            },
            Check { q: quotient(g, "ratio-least-request", "epp-active"), limit: 1.25, strict: false },
            Check {
                q: quotient(g, "ratio", "static-ratio"),
                limit: if r.scenario == "slow-drift" { 1.0 } else { 1.5 },
                strict: r.scenario == "slow-drift",
            },
        ];
        if checks.iter().all(|c| c.q.is_none()) {
            continue;
        }
        for c in &checks {
            if let Some(ok) = c.met() {
                total += 1;
                met += usize::from(ok);
            }
        }
        let mark = if halve { " (<= 0.5)" } else { "" };
        let _ = writeln!(
            out,
            "| {} | {}{mark} | {} | {} |",
            label(r),
            checks[0].cell(),
            checks[1].cell(),
            checks[2].cell()
        );
    }
    let _ = writeln!(out, "\n{met} of {total} goal checks met.");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_points() {
        assert_eq!(summary(&[3.0, 1.0, 2.0]), Some((2.0, 1.0, 3.0)));
        assert_eq!(summary(&[4.0, 1.0]), Some((2.5, 1.0, 4.0)));
        assert_eq!(summary(&[]), None);
        let p = points(&[]);
        assert!(p.contains(&("tp-mixed".to_string(), 0.95, 1)));
        assert!(p.contains(&("mixed-memory".to_string(), 0.85, 32)));
        assert!(p.contains(&("shared-backends".to_string(), 0.85, 1)));
        assert_eq!(points(&["mem-only".to_string()]), vec![("mem-only".to_string(), 0.85, 1)]);
        assert!(p.contains(&("shared-prefix".to_string(), 0.85, 4)));
    }
}
