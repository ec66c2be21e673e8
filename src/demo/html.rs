//! The demo's HTML report: the summary table and SVG charts (KV usage and weights per replica over
//! time, TTFT distribution per phase), self-contained in one file.
//!
//! Replicas are named by their role in the fleet (`replica 3, speed 0.4`), not by their loopback
//! port, which says nothing to a reader. Legends sit in a column right of the plot, never on the
//! lines: the interesting moment (the slow replica's queue, the weights moving) is often in the
//! corner a legend box would cover.

use plotters::prelude::*;

use super::load::Outcome;
use super::{Tick, PHASES};

/// Series `i`'s colour: the palette every chart of ours is drawn with.
fn color(i: usize) -> RGBColor {
    let (r, g, b) = llm_lc_common::PALETTE[i % llm_lc_common::PALETTE.len()];
    RGBColor(r, g, b)
}

/// Width of a chart and of the legend column on its right, in pixels.
const WIDTH: u32 = 900;
const LEGEND_WIDTH: u32 = 170;

/// How the report (and the live view) names replica `i`.
pub fn replica_label(i: usize, speed: f64) -> String {
    format!("replica {i}, speed {speed}")
}

/// The legend, one line per series, drawn in its own area beside the plot.
fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    entries: &[(String, RGBColor)],
) {
    for (i, (label, color)) in entries.iter().enumerate() {
        let y = 40 + 20 * i as i32;
        let _ = area.draw(&PathElement::new(vec![(6, y), (26, y)], color.stroke_width(3)));
        let _ = area.draw(&Text::new(label.clone(), (32, y - 7), ("sans-serif", 13)));
    }
}

/// A line chart of one value per replica over time, with phase boundaries marked.
fn series_chart(
    title: &str,
    ticks: &[Tick],
    members: &[String],
    speeds: &[f64],
    y_max: f64,
    value: impl Fn(&Tick, usize) -> f64,
) -> String {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 320)).into_drawing_area();
        let _ = root.fill(&WHITE);
        let (plot, key) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
        let t_max = ticks.last().map(|t| t.t).unwrap_or(1.0).max(1.0);
        let Ok(mut chart) = ChartBuilder::on(&plot)
            .caption(title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max.max(1e-9))
        else {
            return svg_placeholder(title);
        };
        let _ = chart.configure_mesh().x_desc("seconds").draw();
        // Phase boundaries.
        for w in ticks.windows(2) {
            if w[0].phase != w[1].phase {
                let x = w[1].t;
                let _ = chart.draw_series(LineSeries::new(vec![(x, 0.0), (x, y_max)], BLACK.mix(0.4)));
            }
        }
        let mut entries = Vec::new();
        for i in 0..members.len() {
            let color = color(i);
            let _ = chart.draw_series(LineSeries::new(
                ticks.iter().map(|t| (t.t, value(t, i))),
                color.stroke_width(2),
            ));
            entries.push((replica_label(i, speeds.get(i).copied().unwrap_or(1.0)), color));
        }
        legend(&key, &entries);
        let _ = root.present();
    }
    svg
}

fn ttft_cdf(outcomes: &[Outcome]) -> String {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 320)).into_drawing_area();
        let _ = root.fill(&WHITE);
        let (plot, key) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
        let per_phase: Vec<Vec<f64>> = (0..PHASES.len())
            .map(|p| {
                let mut v: Vec<f64> =
                    outcomes.iter().filter(|o| o.phase == p).filter_map(|o| o.ttft).collect();
                v.sort_by(f64::total_cmp);
                v
            })
            .collect();
        let x_max = per_phase.iter().flat_map(|v| v.last()).cloned().fold(0.1, f64::max);
        let Ok(mut chart) = ChartBuilder::on(&plot)
            .caption("Time to first token, distribution per phase", ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d((0.001f64..x_max).log_scale(), 0.0..1.0)
        else {
            return svg_placeholder("TTFT");
        };
        let _ = chart.configure_mesh().x_desc("seconds (log)").y_desc("fraction of requests").draw();
        let mut entries = Vec::new();
        for (p, v) in per_phase.iter().enumerate() {
            if v.is_empty() {
                continue;
            }
            let color = color(p);
            let n = v.len() as f64;
            let pts = v.iter().enumerate().map(|(i, x)| (x.max(0.001), (i + 1) as f64 / n));
            let _ = chart.draw_series(LineSeries::new(pts, color.stroke_width(2)));
            entries.push((format!("{}. {}", p + 1, PHASES[p]), color));
        }
        legend(&key, &entries);
        let _ = root.present();
    }
    svg
}

fn svg_placeholder(title: &str) -> String {
    format!("<p>(chart {title} could not be drawn)</p>")
}

pub fn report(
    ticks: &[Tick],
    outcomes: &[Outcome],
    members: &[String],
    speeds: &[f64],
    summary: &str,
) -> String {
    let kv = series_chart(
        "KV-cache usage per replica (phases: round robin | dynamic ratios | spike)",
        ticks,
        members,
        speeds,
        1.0,
        |t, i| t.kv.get(i).copied().unwrap_or(0.0),
    );
    let max_q = ticks.iter().flat_map(|t| t.waiting.iter()).copied().max().unwrap_or(1).max(1) as f64;
    let queue = series_chart("Waiting requests per replica", ticks, members, speeds, max_q, |t, i| {
        t.waiting.get(i).copied().unwrap_or(0) as f64
    });
    let max_w = ticks.iter().flat_map(|t| t.weights.iter()).copied().max().unwrap_or(1).max(1) as f64;
    let weights = series_chart(
        "Weight given to each replica (controller ratios from phase 2)",
        ticks,
        members,
        speeds,
        max_w,
        |t, i| t.weights.get(i).copied().unwrap_or(0) as f64,
    );
    let cdf = ttft_cdf(outcomes);
    let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    // Where each replica listened, once, for a reader who wants to match the report with logs.
    let replicas: String = members
        .iter()
        .enumerate()
        .map(|(i, m)| {
            format!(
                "<tr><td>{}</td><td>{}</td></tr>",
                esc(&replica_label(i, speeds.get(i).copied().unwrap_or(1.0))),
                esc(m)
            )
        })
        .collect();
    format!(
        "<!doctype html><html><head><meta charset=utf-8><title>llm-load-controller demo</title>\
         <style>body{{font-family:sans-serif;max-width:960px;margin:2em auto}}pre{{background:#f4f4f4;padding:1em}}</style></head><body>\
         <h1>llm-load-controller demo</h1>\
         <p>A simulated vLLM fleet with one slow replica. Phase 1 spreads requests round robin (equal weights); \
         phase 2 uses the controller's ratios as weights; phase 3 raises the arrival rate.</p>\
         <pre>{}</pre>\
         <table><tr><th align=left>replica</th><th align=left>address</th></tr>{replicas}</table>\
         {kv}{queue}{weights}{cdf}</body></html>",
        esc(summary)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticks() -> Vec<Tick> {
        (0..30)
            .map(|k| Tick {
                t: k as f64,
                phase: k / 10,
                kv: vec![0.2, 0.3, 0.25, 0.9],
                waiting: vec![0, 1, 0, 7],
                running: vec![4, 4, 4, 4],
                weights: vec![60, 58, 61, 20],
            })
            .collect()
    }

    /// The `x` of every `<text>` element whose content contains `needle`.
    fn text_x(svg: &str, needle: &str) -> Vec<f64> {
        svg.split("<text")
            .skip(1)
            .filter(|el| el.split('>').nth(1).is_some_and(|body| body.contains(needle)))
            .filter_map(|el| el.split("x=\"").nth(1)?.split('"').next()?.parse().ok())
            .collect()
    }

    #[test]
    fn the_report_names_replicas_by_role_with_legends_beside_the_plot() {
        let members: Vec<String> = (0..4).map(|i| format!("127.0.0.1:{}", 18000 + i)).collect();
        let speeds = [1.0, 1.0, 1.0, 0.4];
        let html = report(&ticks(), &[], &members, &speeds, "summary");
        assert!(html.contains("replica 3, speed 0.4"), "no role names");
        // The address appears once, in the replica table, not in chart legends.
        assert_eq!(html.matches("127.0.0.1:18003").count(), 1, "ports in the legends");
        let xs = text_x(&html, "replica 3, speed 0.4");
        // Three per-replica charts, each with its legend right of the plot area.
        assert_eq!(xs.len(), 3, "{xs:?}");
        let plot_right = (WIDTH - LEGEND_WIDTH) as f64;
        assert!(xs.iter().all(|&x| x >= plot_right), "legend over the plot: {xs:?} < {plot_right}");
    }
}
