//! PNG plots of a sweep: tokens/s against parameters, and step time against sequence length.

use std::path::Path;

use plotters::prelude::*;

use crate::sweep::{si, Row};

const COLORS: [RGBColor; 6] = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];

/// One line of a plot: its legend and its points.
type Series = (String, Vec<(f64, f64)>);

/// `(lo, hi)` of `values`, widened where they are one value (a log axis needs a range).
fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if !lo.is_finite() {
        return (0.1, 10.0);
    }
    (lo / 1.5, hi * 1.5)
}

/// An axis label: [`si`] without trailing zeros ("2M", "2.5k", "0.3").
fn tick(x: f64) -> String {
    let text = si(x);
    let split = text.find(|c: char| c.is_alphabetic()).unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let number = if number.contains('.') {
        number.trim_end_matches('0').trim_end_matches('.')
    } else {
        number
    };
    format!("{number}{suffix}")
}

/// The 1–2–5 values of every decade in `[lo, hi]`: where a log axis has its labels.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut ticks = Vec::new();
    let mut decade = 10f64.powf(lo.log10().floor());
    while decade <= hi {
        for m in [1.0, 2.0, 5.0] {
            let v = m * decade;
            if (lo..=hi).contains(&v) {
                ticks.push(v);
            }
        }
        decade *= 10.0;
    }
    ticks
}

/// A log–log chart of `series` at `path`.
fn chart(
    path: &Path,
    (title, x_desc, y_desc): (&str, &str, &str),
    series: &[Series],
    labels: bool,
) -> Result<(), String> {
    let root = BitMapBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let points = || series.iter().flat_map(|s| s.1.iter().copied());
    let (x0, x1) = range(points().map(|p| p.0));
    let (y0, y1) = range(points().map(|p| p.1));
    let mut builder = ChartBuilder::on(&root);
    builder
        .margin(15)
        .x_label_area_size(if labels { 45 } else { 5 })
        .y_label_area_size(if labels { 70 } else { 5 });
    if labels {
        builder.caption(title, ("sans-serif", 22));
    }
    let mut chart = builder
        .build_cartesian_2d(
            (x0..x1).log_scale().with_key_points(ticks(x0, x1)),
            (y0..y1).log_scale().with_key_points(ticks(y0, y1)),
        )
        .map_err(|e| e.to_string())?;
    let mut mesh = chart.configure_mesh();
    if labels {
        mesh.x_desc(x_desc)
            .y_desc(y_desc)
            .light_line_style(WHITE)
            .x_label_formatter(&|x| tick(*x))
            .y_label_formatter(&|y| tick(*y));
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(|e| e.to_string())?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let drawn = chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?;
        if labels {
            drawn.label(name.as_str()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        }
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    if labels {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

/// Rows grouped by `key` in order of first appearance, each group as the points `point` gives.
fn group(
    rows: &[Row],
    key: impl Fn(&Row) -> String,
    point: impl Fn(&Row) -> (f64, f64),
) -> Vec<Series> {
    let mut series: Vec<Series> = Vec::new();
    for row in rows {
        let name = key(row);
        match series.iter_mut().find(|s| s.0 == name) {
            Some(s) => s.1.push(point(row)),
            None => series.push((name, vec![point(row)])),
        }
    }
    for s in &mut series {
        s.1.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    series
}

/// Writes `tokens_per_s.png` (tokens/s against total parameters, a line per backend and
/// sequence length) and `step_time.png` (step time against sequence length, a line per backend
/// and preset) into `dir`.
pub fn write_plots(dir: &Path, rows: &[Row], labels: bool) -> Result<(), String> {
    let by_seq = group(
        rows,
        |r| format!("{}, seq {}", r.backend, r.seq_len),
        |r| (r.total_params as f64, r.tokens_per_s),
    );
    chart(
        &dir.join("tokens_per_s.png"),
        ("training throughput", "total parameters", "tokens / s"),
        &by_seq,
        labels,
    )?;
    let by_preset = group(
        rows,
        |r| format!("{}, {}", r.backend, r.preset),
        |r| (r.seq_len as f64, r.step_time_s),
    );
    chart(
        &dir.join("step_time.png"),
        (
            "training step time",
            "sequence length (tokens)",
            "seconds per step",
        ),
        &by_preset,
        labels,
    )
}
