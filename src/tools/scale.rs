//! `bench --controller-scale`: what the controller's cycle costs at 10,000 members, whatever the
//! pools' shape (1,000 x 10 or 1 x 10,000).
//!
//! Measured, per control cycle over every pool, with the code the controller runs, minus the
//! network: (1) samples -> snapshot: [`crate::source::assemble`] from per-signal values (what both
//! sources do after parsing), including building those value maps; (2) the pool's
//! [`Cycle::step`]: the policy (capacity, the default) and every decision rule. What a sink then
//! does with the ratios (HAProxy's plan, Envoy's assignment) is measured in the adapters' own tests.
//!
//! The members' loads follow a seeded random walk so ratios keep changing (a worst case). Memory is
//! the process's resident set from `/proc/self/status` (Linux), before the pools exist, after setup
//! and after the cycles, plus the peak.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::bail;
use llm_lc_adapters::{MemberId, MemberMap, Ratios};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::cycle::OnStale;
use crate::cycle::{Cycle, CycleSettings, Decision, PushResult, Sampled};
use crate::policy::{PolicyConfig, PoolPolicy};
use crate::ratio::RatioRange;
use crate::source::profile::Signal;
use crate::source::{assemble, SignalValues};

const INTERVAL: Duration = Duration::from_secs(5);

/// Members whose ratio differs from `before` (one walk of both, in member order).
fn changed(now: &Ratios, before: &Ratios) -> usize {
    let had = before.as_map().aligned(now.members());
    now.iter().zip(had).filter(|((_, r), h)| *h != Some(r)).count()
}

/// Milliseconds per cycle of one stage: median, p99 (of the measured cycles) and max.
#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    pub median_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    pub pools: usize,
    pub members_per_pool: usize,
    pub members: usize,
    pub cycles: usize,
    pub policy: String,
    pub cycle: Timing,
    pub snapshot: Timing,
    /// [`Cycle::step`]: the policy and every decision rule (fail-static, drain guard, change policy).
    pub cycle_step: Timing,
    /// Members whose ratio changed, per cycle, on average.
    pub changed_members_per_cycle: f64,
    pub setup_ms: f64,
    /// Resident memory, MiB (`None` where /proc is not available).
    pub rss_start_mib: Option<f64>,
    pub rss_after_setup_mib: Option<f64>,
    pub rss_end_mib: Option<f64>,
    pub rss_peak_mib: Option<f64>,
}

fn proc_status_kib(field: &str) -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse::<f64>().ok()
}

fn mib(kib: Option<f64>) -> Option<f64> {
    kib.map(|k| k / 1024.0)
}

struct Pool {
    members: Vec<MemberId>,
    cycle: Cycle,
    load: Vec<f64>,
}

fn timing(mut v: Vec<f64>) -> Timing {
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Timing { median_ms: at(0.5), p99_ms: at(0.99), max_ms: v[v.len() - 1] }
}

/// Build `pools` pools of `members` members and time `cycles` control cycles over all of them.
pub fn measure(pools: usize, members: usize, cycles: usize, seed: u64) -> anyhow::Result<ScaleReport> {
    if pools == 0 || members == 0 || cycles == 0 {
        bail!("--pools, --members and --cycles must all be at least 1");
    }
    if pools * members > 16_000_000 {
        bail!("at most 16 million members (addresses are 10.x.y.z)");
    }
    let rss_start = proc_status_kib("VmRSS:");
    let setup = Instant::now();
    let cfg = PolicyConfig::default();
    let range = RatioRange::default();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut all: Vec<Pool> = (0..pools)
        .map(|p| {
            let mut members: Vec<MemberId> = (0..members)
                .map(|m| {
                    let k = (p * members + m) as u32;
                    MemberId::new(format!(
                        "{}:8000",
                        Ipv4Addr::new(10, (k >> 16) as u8, (k >> 8) as u8, k as u8)
                    ))
                })
                .collect();
            // The controller keeps every pool's members in member order (see `controller::sorted`).
            members.sort();
            let policy =
                PoolPolicy::new(&cfg, range, Duration::from_secs(60), Duration::from_secs(30), INTERVAL);
            let mut settings = CycleSettings::new(range, OnStale::Hold, Duration::from_secs(300));
            settings.reconciles = true;
            Pool {
                cycle: Cycle::new(settings, policy),
                load: (0..members.len()).map(|_| rng.gen_range(0.1..0.9)).collect(),
                members,
            }
        })
        .collect();
    let setup_ms = setup.elapsed().as_secs_f64() * 1e3;
    let rss_setup = proc_status_kib("VmRSS:");

    let (mut t_cycle, mut t_snap, mut t_step) = (vec![], vec![], vec![]);
    let epoch = Instant::now();
    let mut pool_prev: Vec<Ratios> = vec![Ratios::default(); all.len()];
    let mut changed_total = 0usize;
    for cycle in 0..cycles {
        // The world moves (not timed).
        let worlds: Vec<Vec<(f64, f64, f64)>> = all
            .iter_mut()
            .map(|pool| {
                pool.load
                    .iter_mut()
                    .map(|l| {
                        *l = (*l + rng.gen_range(-0.1..0.1)).clamp(0.0, 1.5);
                        let kv = l.min(1.0);
                        (((*l - 1.0).max(0.0) * 16.0).round(), (kv * 128.0).round(), kv)
                    })
                    .collect()
            })
            .collect();
        let (mut s, mut p) = (0.0, 0.0);
        let cycle_start = Instant::now();
        for (k, (pool, world)) in all.iter_mut().zip(&worlds).enumerate() {
            let t0 = Instant::now();
            // As the sources build them: one column per signal, in member order.
            let column = |f: fn(&(f64, f64, f64)) -> f64| -> MemberMap<f64> {
                pool.members.iter().zip(world).map(|(m, w)| (m.clone(), f(w))).collect()
            };
            let values: SignalValues = BTreeMap::from([
                (Signal::Waiting, column(|w| w.0)),
                (Signal::Running, column(|w| w.1)),
                (Signal::KvUsage, column(|w| w.2)),
            ]);
            let snap = assemble(&pool.members, &values, |_, _| Duration::from_secs(2));
            let t1 = Instant::now();
            let now = epoch + INTERVAL * cycle as u32;
            let step = pool.cycle.step(Sampled::Snapshot(&snap), &pool.members, now, true);
            if let Decision::Push(sent) = &step.decision {
                let changed = step.policy.as_ref().map(|o| changed(&o.ratios, &pool_prev[k])).unwrap_or(0);
                changed_total += changed;
                std::hint::black_box(sent);
                pool.cycle.pushed(PushResult::Applied { changed }, now);
            }
            pool_prev[k] = step.desired;
            let t2 = Instant::now();
            s += (t1 - t0).as_secs_f64();
            p += (t2 - t1).as_secs_f64();
        }
        t_cycle.push(cycle_start.elapsed().as_secs_f64() * 1e3);
        t_snap.push(s * 1e3);
        t_step.push(p * 1e3);
    }
    Ok(ScaleReport {
        pools,
        members_per_pool: members,
        members: pools * members,
        cycles,
        policy: cfg.name().to_string(),
        cycle: timing(t_cycle),
        snapshot: timing(t_snap),
        cycle_step: timing(t_step),
        changed_members_per_cycle: changed_total as f64 / cycles as f64,
        setup_ms,
        rss_start_mib: mib(rss_start),
        rss_after_setup_mib: mib(rss_setup),
        rss_end_mib: mib(proc_status_kib("VmRSS:")),
        rss_peak_mib: mib(proc_status_kib("VmHWM:")),
    })
}

/// Human summary.
pub fn render(r: &ScaleReport) -> String {
    let mut out = String::new();
    let t =
        |x: &Timing| format!("median {:.2} ms, p99 {:.2} ms, max {:.2} ms", x.median_ms, x.p99_ms, x.max_ms);
    let m = |x: Option<f64>| x.map(|v| format!("{v:.1} MiB")).unwrap_or_else(|| "n/a".into());
    let _ = writeln!(
        out,
        "controller cost: {} members in {} pools of {}, {} policy, {} cycles (CPU only, no network)",
        r.members, r.pools, r.members_per_pool, r.policy, r.cycles
    );
    let _ = writeln!(out, "  whole cycle:        {}", t(&r.cycle));
    let _ = writeln!(out, "  samples->snapshot:  {}", t(&r.snapshot));
    let _ = writeln!(out, "  cycle step:         {}", t(&r.cycle_step));
    let _ = writeln!(out, "  members changed per cycle: {:.0}", r.changed_members_per_cycle);
    let _ = writeln!(
        out,
        "  memory (RSS): {} at start, {} after setup ({:.0} ms), {} at end, peak {}",
        m(r.rss_start_mib),
        m(r.rss_after_setup_mib),
        r.setup_ms,
        m(r.rss_end_mib),
        m(r.rss_peak_mib)
    );
    out
}
