//! SVG pictures of a scenario run (`--plot DIR`), drawn with `plotters`:
//! - `<scenario>-<load>-kv-queue.svg`: KV usage and waiting requests per replica over time, one row
//!   per balancer among round-robin, ratio, ratio-least-request (and ratio-p2c, epp when run);
//! - `<scenario>-<load>-ttft-cdf.svg`: the TTFT distribution of every balancer (log time axis);
//! - `<scenario>-<load>-weights.svg`: the controller's ratios over time, per ratio balancer.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::fleet::{RunOutcome, Series};
use super::ScenarioRun;

/// Longest polyline drawn: series are thinned to this many points.
const MAX_POINTS: usize = 400;

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing failed: {e:?}")
}

/// The palette of every chart we draw (the demo's report too).
pub fn color(i: usize) -> RGBColor {
    let (r, g, b) = llm_lc_common::PALETTE[i % llm_lc_common::PALETTE.len()];
    RGBColor(r, g, b)
}

fn stride(n: usize) -> usize {
    n.div_ceil(MAX_POINTS).max(1)
}

/// Write every picture for one scenario run; returns the files written.
pub fn write_all(dir: &Path, run: &ScenarioRun) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create plot directory {}", dir.display()))?;
    let stem = format!("{}-{:.0}", run.report.scenario, run.report.load * 100.0);
    let mut files = Vec::new();
    let kv = dir.join(format!("{stem}-kv-queue.svg"));
    if kv_queue(&kv, run)? {
        files.push(kv);
    }
    let cdf = dir.join(format!("{stem}-ttft-cdf.svg"));
    ttft_cdf(&cdf, run)?;
    files.push(cdf);
    let w = dir.join(format!("{stem}-weights.svg"));
    if weights(&w, run)? {
        files.push(w);
    }
    Ok(files)
}

fn title(run: &ScenarioRun) -> String {
    format!("{} at {:.0}% load", run.report.scenario, run.report.load * 100.0)
}

fn replica_label(run: &ScenarioRun, r: usize) -> String {
    let speed = run.report.speeds.get(r).copied().unwrap_or(1.0);
    match run.report.kv_scale.get(r) {
        Some(&kv) if kv != 1.0 => format!("replica {r} (speed {speed:.2}, KV x{kv:.2})"),
        _ => format!("replica {r} (speed {speed:.2})"),
    }
}

fn kv_queue(path: &Path, run: &ScenarioRun) -> anyhow::Result<bool> {
    let wanted = ["round-robin", "ratio", "ratio-least-request", "ratio-p2c", "epp"];
    let rows: Vec<(&RunOutcome, &Series)> = run
        .outcomes
        .iter()
        .filter(|o| wanted.contains(&o.result.balancer.as_str()))
        .filter_map(|o| o.series.as_ref().map(|s| (o, s)))
        .collect();
    if rows.is_empty() {
        return Ok(false);
    }
    let height = 60 + 260 * rows.len() as u32;
    let root = SVGBackend::new(path, (1400, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (top, body) = root.split_vertically(40);
    top.titled(&format!("{}: KV usage and queue per replica", title(run)), ("sans-serif", 22))
        .map_err(err)?;
    let max_wait = rows.iter().flat_map(|(_, s)| s.waiting.iter().flatten()).fold(1.0f32, |a, &b| a.max(b));
    // One time axis for every panel, so rows line up even when one balancer drains longer.
    let t_max = rows.iter().filter_map(|(_, s)| s.t.last().copied()).fold(1.0f32, f32::max);
    let cells = body.split_evenly((rows.len(), 2));
    for (k, (o, s)) in rows.iter().enumerate() {
        let name = &o.result.balancer;
        let kv =
            Panel { data: &s.kv, caption: format!("{name}: KV usage"), y_max: 1.0, t_max, legend: k == 0 };
        panel(&cells[2 * k], run, s, &kv)?;
        let q = Panel {
            data: &s.waiting,
            caption: format!("{name}: waiting requests"),
            y_max: max_wait * 1.05,
            t_max,
            legend: false,
        };
        panel(&cells[2 * k + 1], run, s, &q)?;
    }
    root.present().map_err(err)?;
    Ok(true)
}

/// One panel of per-replica lines.
struct Panel<'a> {
    data: &'a [Vec<f32>],
    caption: String,
    y_max: f32,
    t_max: f32,
    legend: bool,
}

fn panel(
    area: &DrawingArea<SVGBackend, Shift>,
    run: &ScenarioRun,
    s: &Series,
    p: &Panel,
) -> anyhow::Result<()> {
    let (data, y_max, t_max, legend) = (p.data, p.y_max, p.t_max, p.legend);
    let mut chart = ChartBuilder::on(area)
        .caption(&p.caption, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(0f32..t_max, 0f32..y_max)
        .map_err(err)?;
    chart.configure_mesh().x_desc("virtual time (s)").light_line_style(WHITE).draw().map_err(err)?;
    let step = stride(s.t.len());
    for (r, ys) in data.iter().enumerate() {
        let c = color(r);
        let pts = s.t.iter().zip(ys).step_by(step).map(|(&t, &y)| (t, y));
        let drawn = chart.draw_series(LineSeries::new(pts, c.stroke_width(1))).map_err(err)?;
        if legend {
            drawn
                .label(replica_label(run, r))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        }
    }
    if legend {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

fn ttft_cdf(path: &Path, run: &ScenarioRun) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let lo = run
        .outcomes
        .iter()
        .filter_map(|o| o.ttft_sorted.first().copied())
        .fold(f32::INFINITY, f32::min)
        .max(1e-3) as f64;
    let hi = run.report.timeout_s.max(lo * 10.0);
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{}: TTFT distribution per balancer", title(run)), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((lo * 0.8..hi * 1.1).log_scale(), 0f64..1f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("time to first token (s, log scale)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(err)?;
    for (i, o) in run.outcomes.iter().enumerate() {
        let v = &o.ttft_sorted;
        if v.is_empty() {
            continue;
        }
        let n = v.len();
        let k = 600.min(n);
        let pts: Vec<(f64, f64)> = (0..=k)
            .map(|j| {
                let idx = ((j as f64 / k as f64) * (n - 1) as f64).round() as usize;
                ((v[idx] as f64).max(lo * 0.8), (idx + 1) as f64 / n as f64)
            })
            .collect();
        let c = color(i);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(err)?
            .label(o.result.balancer.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

fn weights(path: &Path, run: &ScenarioRun) -> anyhow::Result<bool> {
    let rows: Vec<(&RunOutcome, &Series)> = run
        .outcomes
        .iter()
        .filter(|o| !o.result.final_weights.is_empty())
        .filter_map(|o| o.series.as_ref().map(|s| (o, s)))
        .filter(|(_, s)| !s.weights.is_empty())
        .collect();
    if rows.is_empty() {
        return Ok(false);
    }
    let root = SVGBackend::new(path, (1000, 60 + 280 * rows.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (top, body) = root.split_vertically(40);
    top.titled(&format!("{}: the controller's ratios", title(run)), ("sans-serif", 22)).map_err(err)?;
    let cells = body.split_evenly((rows.len(), 1));
    for (k, (o, s)) in rows.iter().enumerate() {
        let t_max = run.report.duration_s as f32;
        let y_max = s.weights.iter().flatten().copied().max().unwrap_or(1) as f32 * 1.1;
        let mut chart = ChartBuilder::on(&cells[k])
            .caption(format!("{} ratios", o.result.balancer), ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(28)
            .y_label_area_size(48)
            .build_cartesian_2d(0f32..t_max, 0f32..y_max)
            .map_err(err)?;
        chart.configure_mesh().x_desc("virtual time (s)").light_line_style(WHITE).draw().map_err(err)?;
        let n = s.weights.first().map(|w| w.len()).unwrap_or(0);
        for r in 0..n {
            let c = color(r);
            // After the window the pool drains and goes idle: not what the ratios are about.
            let pts = s
                .weight_t
                .iter()
                .zip(&s.weights)
                .filter(|(&t, _)| f64::from(t) <= run.report.duration_s)
                .map(|(&t, w)| (t, w[r] as f32));
            let drawn = chart.draw_series(LineSeries::new(pts, c.stroke_width(2))).map_err(err)?;
            if k == 0 {
                drawn
                    .label(replica_label(run, r))
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
            }
        }
        if k == 0 {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(err)?;
        }
    }
    root.present().map_err(err)?;
    Ok(true)
}
