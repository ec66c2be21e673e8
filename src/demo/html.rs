//! The demo's HTML report: the summary table and SVG charts (KV usage and weights per replica over
//! time, TTFT distribution per phase), self-contained in one file.

use plotters::prelude::*;

use super::load::Outcome;
use super::{Tick, PHASES};

use llm_lc_bench::plot::color;

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
        let root = SVGBackend::with_string(&mut svg, (900, 320)).into_drawing_area();
        let _ = root.fill(&WHITE);
        let t_max = ticks.last().map(|t| t.t).unwrap_or(1.0).max(1.0);
        let Ok(mut chart) = ChartBuilder::on(&root)
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
        for (i, m) in members.iter().enumerate() {
            let color = color(i);
            let label = format!("{m} (speed {})", speeds.get(i).copied().unwrap_or(1.0));
            if let Ok(s) = chart
                .draw_series(LineSeries::new(ticks.iter().map(|t| (t.t, value(t, i))), color.stroke_width(2)))
            {
                s.label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
            }
        }
        let _ = chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw();
        let _ = root.present();
    }
    svg
}

fn ttft_cdf(outcomes: &[Outcome]) -> String {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 320)).into_drawing_area();
        let _ = root.fill(&WHITE);
        let per_phase: Vec<Vec<f64>> = (0..PHASES.len())
            .map(|p| {
                let mut v: Vec<f64> =
                    outcomes.iter().filter(|o| o.phase == p).filter_map(|o| o.ttft).collect();
                v.sort_by(f64::total_cmp);
                v
            })
            .collect();
        let x_max = per_phase.iter().flat_map(|v| v.last()).cloned().fold(0.1, f64::max);
        let Ok(mut chart) = ChartBuilder::on(&root)
            .caption("Time to first token, distribution per phase", ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d((0.001f64..x_max).log_scale(), 0.0..1.0)
        else {
            return svg_placeholder("TTFT");
        };
        let _ = chart.configure_mesh().x_desc("seconds (log)").y_desc("fraction of requests").draw();
        for (p, v) in per_phase.iter().enumerate() {
            if v.is_empty() {
                continue;
            }
            let color = color(p);
            let n = v.len() as f64;
            let pts = v.iter().enumerate().map(|(i, x)| (x.max(0.001), (i + 1) as f64 / n));
            if let Ok(s) = chart.draw_series(LineSeries::new(pts, color.stroke_width(2))) {
                s.label(PHASES[p])
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
            }
        }
        let _ = chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw();
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
    format!(
        "<!doctype html><html><head><meta charset=utf-8><title>llm-load-controller demo</title>\
         <style>body{{font-family:sans-serif;max-width:960px;margin:2em auto}}pre{{background:#f4f4f4;padding:1em}}</style></head><body>\
         <h1>llm-load-controller demo</h1>\
         <p>A simulated vLLM fleet with one slow replica. Phase 1 spreads requests round robin (equal weights); \
         phase 2 uses the controller's ratios as weights; phase 3 raises the arrival rate.</p>\
         <pre>{}</pre>{kv}{queue}{weights}{cdf}</body></html>",
        esc(summary)
    )
}
