//! The demo's terminal view (redrawn in place, or plain lines when not on a terminal) and the
//! per-phase summary.

use std::fmt::Write as _;
use std::time::Duration;

use super::load::Outcome;
use super::{Tick, PHASES};

/// Per-phase figures for the summary and the report.
#[derive(Debug, Clone, Default)]
pub struct PhaseStats {
    pub requests: usize,
    pub failed: usize,
    pub ttft_p50: Option<f64>,
    pub ttft_p99: Option<f64>,
    pub tokens_per_s: f64,
    /// Over the whole phase, including the transition from the previous one.
    pub kv_spread: Option<f64>,
    /// Over the second half of the phase, once the new weights have taken effect.
    pub kv_spread_settled: Option<f64>,
}

/// The nearest-rank percentile the bench quotes too ([`llm_lc_common::percentile`]).
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    llm_lc_common::percentile(sorted, q)
}

pub fn phase_stats(ticks: &[Tick], outcomes: &[Outcome], phase: usize) -> PhaseStats {
    let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.phase == phase).collect();
    let mut ttft: Vec<f64> = mine.iter().filter_map(|o| o.ttft).collect();
    ttft.sort_by(f64::total_cmp);
    let pt: Vec<&Tick> = ticks.iter().filter(|t| t.phase == phase).collect();
    let spreads: Vec<f64> = pt
        .iter()
        .filter(|t| !t.kv.is_empty())
        .map(|t| {
            t.kv.iter().cloned().fold(f64::MIN, f64::max) - t.kv.iter().cloned().fold(f64::MAX, f64::min)
        })
        .collect();
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let settled = &spreads[spreads.len() / 2..];
    let span = match (pt.first(), pt.last()) {
        (Some(a), Some(b)) if b.t > a.t => b.t - a.t,
        _ => 0.0,
    };
    PhaseStats {
        requests: mine.len(),
        failed: mine.iter().filter(|o| !o.ok).count(),
        ttft_p50: percentile(&ttft, 0.5),
        ttft_p99: percentile(&ttft, 0.99),
        tokens_per_s: if span > 0.0 { mine.iter().map(|o| o.tokens as f64).sum::<f64>() / span } else { 0.0 },
        kv_spread: mean(&spreads),
        kv_spread_settled: mean(settled),
    }
}

fn secs(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.2}s")).unwrap_or_else(|| "-".into())
}

pub fn summary(ticks: &[Tick], outcomes: &[Outcome]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<18} {:>9} {:>7} {:>9} {:>9} {:>7} {:>10} {:>10}",
        "phase", "requests", "failed", "TTFT p50", "TTFT p99", "tok/s", "KV spread", "settled"
    );
    for (i, name) in PHASES.iter().enumerate() {
        let p = phase_stats(ticks, outcomes, i);
        if p.requests == 0 && p.kv_spread.is_none() {
            continue;
        }
        let pct = |v: Option<f64>| v.map(|v| format!("{:.0}%", v * 100.0)).unwrap_or_else(|| "-".into());
        let _ = writeln!(
            s,
            "{:<18} {:>9} {:>7} {:>9} {:>9} {:>7.0} {:>10} {:>10}",
            format!("{}. {name}", i + 1),
            p.requests,
            p.failed,
            secs(p.ttft_p50),
            secs(p.ttft_p99),
            p.tokens_per_s,
            pct(p.kv_spread),
            pct(p.kv_spread_settled)
        );
    }
    let _ = write!(
        s,
        "KV spread = time-average of (max - min) KV-cache usage across replicas, over the whole phase and over its\n\
         second half (settled, after the backlog of the previous phase has drained). TTFT measured at the client."
    );
    s
}

fn bar(frac: f64, width: usize) -> String {
    let filled = (frac.clamp(0.0, 1.0) * width as f64).round() as usize;
    format!("{}{}", "█".repeat(filled), "░".repeat(width - filled))
}

pub fn draw(
    ticks: &[Tick],
    members: &[String],
    speeds: &[f64],
    outcomes: &[Outcome],
    total: Duration,
    plain: bool,
) {
    let Some(tick) = ticks.last() else { return };
    let phase = PHASES.get(tick.phase).copied().unwrap_or("");
    if plain {
        // One line every 5 s keeps logs readable.
        if (tick.t * 2.0).round() as u64 % 10 == 0 {
            let kv: Vec<String> = tick.kv.iter().map(|k| format!("{:.0}%", k * 100.0)).collect();
            let q: Vec<String> = tick.waiting.iter().map(|w| w.to_string()).collect();
            let w: Vec<String> = tick.weights.iter().map(|w| w.to_string()).collect();
            println!(
                "t={:>5.1}s phase {} ({phase}): KV [{}] queue [{}] weights [{}]",
                tick.t,
                tick.phase + 1,
                kv.join(" "),
                q.join(" "),
                w.join(" ")
            );
        }
        return;
    }
    let mut s = String::from("\x1b[2J\x1b[H");
    let _ = writeln!(
        s,
        "llm-load-controller demo — phase {}/3: {phase}   t = {:.0}s / {:.0}s   (Ctrl-C stops)\n",
        tick.phase + 1,
        tick.t,
        total.as_secs_f64()
    );
    let _ = writeln!(
        s,
        "{:<28} {:>5}  {:<24} {:>5} {:>7} {:>7} {:>6}",
        "replica", "speed", "KV cache", "KV%", "queue", "running", "ratio"
    );
    for (i, m) in members.iter().enumerate() {
        let kv = tick.kv.get(i).copied().unwrap_or(0.0);
        let _ = writeln!(
            s,
            "{:<28} {:>5.2}  {} {:>4.0}% {:>7} {:>7} {:>6}",
            format!("replica {i} ({m})"),
            speeds.get(i).copied().unwrap_or(1.0),
            bar(kv, 24),
            kv * 100.0,
            tick.waiting.get(i).copied().unwrap_or(0),
            tick.running.get(i).copied().unwrap_or(0),
            if tick.phase == 0 {
                "equal".to_string()
            } else {
                tick.weights.get(i).map(|w| w.to_string()).unwrap_or_default()
            }
        );
    }
    let _ = writeln!(s, "\nso far:");
    s.push_str(&summary(ticks, outcomes).lines().take(4).collect::<Vec<_>>().join("\n"));
    println!("{s}");
}
