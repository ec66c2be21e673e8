//! The endpoint picker's goals (issue 41) and their table: `picker` against the field's per-request
//! pickers where prompts share prefixes (`epp-prefix`, `epp-sticky`), against `epp-active` and the
//! controller's ratios where they do not, with several picker replicas, and near saturation.
//!
//! As in [`super::goals`], a quotient is of medians over seeds, with the range of the per-seed
//! quotients beside it. "The better anchor" is the one with the lower median p99 at that point.

use std::fmt::Write as _;

use super::balancer::Balancer;
use super::fleet::BalancerResult;
use super::goals::{groups, summary};
use super::ScenarioReport;

/// Points only the picker's goals need (scenario, load, LB instances), and their balancers.
pub const POINTS: &[(&str, f64, usize)] = &[
    ("shared-prefix", 0.85, 1),
    ("multi-turn", 0.85, 1),
    ("shared-prefix", 0.85, 4),
    ("shared-prefix", 0.95, 1),
    ("batch-limits", 0.85, 1),
];
/// The anchors where prompts share prefixes.
pub const PREFIX_ANCHORS: [&str; 2] = ["epp-prefix", "epp-sticky"];
/// Points without shared prefixes where the picker is held to `epp-active` and the ratios.
pub const NO_PREFIX: &[&str] = &["heterogeneous", "mixed-memory", "batch-limits"];

/// The balancers a picker-only point runs.
pub fn balancers(scenario: &str) -> Vec<Balancer> {
    if NO_PREFIX.contains(&scenario) {
        vec![Balancer::Picker, Balancer::EppActive, Balancer::RatioLeastRequest]
    } else {
        vec![Balancer::Picker, Balancer::EppPrefix, Balancer::EppSticky]
    }
}

fn values(group: &[&ScenarioReport], balancer: &str, f: fn(&BalancerResult) -> f64) -> Vec<f64> {
    group.iter().filter_map(|r| r.results.iter().find(|b| b.balancer == balancer).map(f)).collect()
}

fn p99(b: &BalancerResult) -> f64 {
    b.ttft_p99_s
}

/// Median quotient `a / b` of one number of two balancers (possibly at two points), and the range
/// of the per-seed quotients (reports paired by position: same seeds, same order).
fn quotient(
    ga: &[&ScenarioReport],
    a: &str,
    gb: &[&ScenarioReport],
    b: &str,
    f: fn(&BalancerResult) -> f64,
) -> Option<(f64, f64, f64)> {
    let (va, vb) = (values(ga, a, f), values(gb, b, f));
    if va.len() != vb.len() || va.is_empty() {
        return None;
    }
    let (ma, mb) = (summary(&va)?.0, summary(&vb)?.0);
    let per: Vec<f64> = va.iter().zip(&vb).map(|(x, y)| x / y.max(1e-12)).collect();
    let (_, lo, hi) = summary(&per)?;
    Some((ma / mb.max(1e-12), lo, hi))
}

/// The anchor with the lower median p99 in `group`.
fn better_anchor<'a>(group: &[&ScenarioReport], anchors: &[&'a str]) -> Option<&'a str> {
    anchors
        .iter()
        .filter_map(|&a| summary(&values(group, a, p99)).map(|(m, _, _)| (a, m)))
        .min_by(|x, y| x.1.total_cmp(&y.1))
        .map(|(a, _)| a)
}

/// One goal: a quotient and its bound (`at_most`: the quotient must not exceed it; else not fall
/// below it).
struct Goal {
    what: String,
    q: Option<(f64, f64, f64)>,
    bound: f64,
    at_most: bool,
}

impl Goal {
    /// Judged at the table's precision (two decimals): 0.9996x of a throughput is 1.00x.
    fn met(&self) -> Option<bool> {
        self.q.map(|(m, _, _)| {
            let m = (m * 100.0).round() / 100.0;
            if self.at_most {
                m <= self.bound
            } else {
                m >= self.bound
            }
        })
    }

    fn cell(&self) -> String {
        let sign = if self.at_most { "<=" } else { ">=" };
        match (self.q, self.met()) {
            (Some((m, lo, hi)), Some(ok)) => format!(
                "{}{}: {m:.2}x ({lo:.2}-{hi:.2}), {sign} {}",
                if ok { "" } else { "**FAIL** " },
                self.what,
                self.bound
            ),
            _ => format!("{}: -", self.what),
        }
    }
}

fn label(r: &ScenarioReport) -> String {
    let mut s = format!("{} {:.0}%", r.scenario, r.load * 100.0);
    if r.lb_instances > 1 {
        let _ = write!(s, " x{} LB", r.lb_instances);
    }
    s
}

/// The picker's goals at every point of `reports` that has them, as a markdown table.
pub fn markdown(reports: &[ScenarioReport]) -> String {
    let groups = groups(reports);
    let find = |scenario: &str, load: f64, k: usize| {
        groups.iter().find(|g| g[0].scenario == scenario && g[0].load == load && g[0].lb_instances == k)
    };
    let mut rows: Vec<(String, Vec<Goal>)> = Vec::new();
    for g in &groups {
        let r = g[0];
        let picker = "picker";
        let goal = |what: &str, q, bound, at_most| Goal { what: what.to_string(), q, bound, at_most };
        let mut goals = Vec::new();
        if NO_PREFIX.contains(&r.scenario.as_str()) && r.load == 0.85 && r.lb_instances == 1 {
            goals.push(goal("p99 / epp-active", quotient(g, picker, g, "epp-active", p99), 0.9, true));
            goals.push(goal(
                "p99 / ratio-least-request",
                quotient(g, picker, g, "ratio-least-request", p99),
                1.0,
                true,
            ));
        } else if matches!(r.scenario.as_str(), "shared-prefix" | "multi-turn") {
            let Some(best) = better_anchor(g, &PREFIX_ANCHORS) else { continue };
            match (r.load == 0.85, r.lb_instances) {
                (true, 1) => {
                    goals.push(goal(&format!("p99 / {best}"), quotient(g, picker, g, best, p99), 0.9, true));
                    goals.push(goal(
                        &format!("p50 / {best}"),
                        quotient(g, picker, g, best, |b| b.ttft_p50_s),
                        1.0,
                        true,
                    ));
                    goals.push(goal(
                        &format!("tok/s / {best}"),
                        quotient(g, picker, g, best, |b| b.throughput_tok_s),
                        1.0,
                        false,
                    ));
                    goals.push(goal(
                        &format!("prefix hits / {best}"),
                        quotient(g, picker, g, best, |b| b.prefix_hit_rate),
                        0.98,
                        false,
                    ));
                }
                (true, 4) => {
                    if let Some(one) = find(&r.scenario, r.load, 1) {
                        goals.push(goal(
                            "p99 / itself on 1 LB",
                            quotient(g, picker, one, picker, p99),
                            1.15,
                            true,
                        ));
                    }
                    goals.push(goal(
                        "p99 / epp-prefix",
                        quotient(g, picker, g, "epp-prefix", p99),
                        0.8,
                        true,
                    ));
                }
                (false, 1) => {
                    goals.push(goal(
                        "requests timed out",
                        summary(&values(g, picker, |b| b.rejected as f64)),
                        0.0,
                        true,
                    ));
                    goals.push(goal(&format!("p99 / {best}"), quotient(g, picker, g, best, p99), 1.0, true));
                }
                _ => {}
            }
        }
        if !goals.is_empty() {
            rows.push((label(r), goals));
        }
    }
    if rows.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\nThe endpoint picker's goals (issue 41): median quotient over seeds (range of per-seed quotients).\n\n| point | goals |\n|---|---|\n",
    );
    let (mut met, mut total) = (0, 0);
    for (label, goals) in &rows {
        for g in goals {
            if let Some(ok) = g.met() {
                total += 1;
                met += usize::from(ok);
            }
        }
        let cells: Vec<String> = goals.iter().map(Goal::cell).collect();
        let _ = writeln!(out, "| {label} | {} |", cells.join("; "));
    }
    let _ = writeln!(out, "\n{met} of {total} picker goal checks met.");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_points_run_the_prefix_anchors_and_the_others_the_load_anchors() {
        assert_eq!(balancers("shared-prefix"), [Balancer::Picker, Balancer::EppPrefix, Balancer::EppSticky]);
        assert_eq!(
            balancers("batch-limits"),
            [Balancer::Picker, Balancer::EppActive, Balancer::RatioLeastRequest]
        );
        assert!(markdown(&[]).is_empty());
    }
}
