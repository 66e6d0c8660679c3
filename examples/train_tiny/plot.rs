//! PNG plots of a training run: loss and accuracy over steps, and expert load per MoE layer.

use std::path::Path;

use plotters::prelude::*;

/// One logged step.
pub struct Row {
    pub step: usize,
    pub loss: f64,
    pub accuracy: f64,
    /// Per MoE layer: (max violation, dead experts).
    pub load: Vec<(f64, usize)>,
    /// Per MoE layer: the max violation of the last `--load-window` steps' loads pooled.
    pub window: Vec<f64>,
}

type Series<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);

fn chart(
    path: &Path,
    title: &str,
    y_label: &str,
    series: &[Series<'_>],
    labels: bool,
) -> Result<(), String> {
    let root = BitMapBackend::new(path, (900, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let x_max = series
        .iter()
        .flat_map(|s| s.2.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let y_max = series
        .iter()
        .flat_map(|s| s.2.iter().map(|p| p.1))
        .filter(|v| v.is_finite())
        .fold(1e-3, f64::max);
    let mut builder = ChartBuilder::on(&root);
    builder
        .margin(15)
        .x_label_area_size(if labels { 40 } else { 5 })
        .y_label_area_size(if labels { 60 } else { 5 });
    if labels {
        builder.caption(title, ("sans-serif", 22));
    }
    let mut chart = builder
        .build_cartesian_2d(0.0..x_max, 0.0..y_max * 1.05)
        .map_err(|e| e.to_string())?;
    let mut mesh = chart.configure_mesh();
    if labels {
        mesh.x_desc("step").y_desc(y_label);
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(|e| e.to_string())?;
    for (name, color, points) in series {
        let drawn = chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
        if labels {
            let c = *color;
            drawn.label(*name).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
            });
        }
    }
    if labels {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

const COLORS: [RGBColor; 6] = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];

/// Writes `loss_accuracy.png`, `expert_load.png` and `expert_load_window.png` (the loads of the
/// last `window` steps pooled) into `dir`.
pub fn write_plots(dir: &Path, rows: &[Row], labels: bool, window: usize) -> Result<(), String> {
    let pts = |f: &dyn Fn(&Row) -> f64| {
        rows.iter()
            .map(|r| (r.step as f64, f(r)))
            .collect::<Vec<_>>()
    };
    chart(
        &dir.join("loss_accuracy.png"),
        "training loss and accuracy",
        "loss / accuracy",
        &[
            ("loss", BLUE, pts(&|r| r.loss)),
            ("accuracy", RED, pts(&|r| r.accuracy)),
        ],
        labels,
    )?;
    let layers = rows.first().map_or(0, |r| r.load.len());
    let mut series: Vec<Series<'_>> = Vec::new();
    let names: Vec<(String, String)> = (0..layers)
        .map(|l| {
            (
                format!("MoE {l}: max violation"),
                format!("MoE {l}: dead experts"),
            )
        })
        .collect();
    for (l, (v, d)) in names.iter().enumerate() {
        let c = COLORS[l % COLORS.len()];
        series.push((v.as_str(), c, pts(&|r| r.load[l].0)));
        series.push((d.as_str(), lighter(c), pts(&|r| r.load[l].1 as f64)));
    }
    // The balance target of the training-run check: max violation below 0.3.
    let last = rows.last().map_or(1.0, |r| r.step as f64);
    let target: Series<'_> = (
        "max violation 0.3",
        BLACK,
        vec![(0.0, MAX_VIOLATION_TARGET), (last, MAX_VIOLATION_TARGET)],
    );
    if layers > 0 {
        series.push(target.clone());
    }
    chart(
        &dir.join("expert_load.png"),
        "expert load per MoE layer",
        "max violation / dead experts",
        &series,
        labels,
    )?;
    let names: Vec<String> = (0..layers)
        .map(|l| format!("MoE {l}: max violation"))
        .collect();
    let mut series: Vec<Series<'_>> = names
        .iter()
        .enumerate()
        .map(|(l, name)| {
            (
                name.as_str(),
                COLORS[l % COLORS.len()],
                pts(&|r| r.window[l]),
            )
        })
        .collect();
    if layers > 0 {
        series.push(target);
    }
    chart(
        &dir.join("expert_load_window.png"),
        &format!("expert load per MoE layer, the last {window} steps pooled"),
        "max violation",
        &series,
        labels,
    )
}

/// The reference line drawn on the expert-load plot.
const MAX_VIOLATION_TARGET: f64 = 0.3;

/// `c` halfway to white: the dead-expert line of a layer next to its violation line.
fn lighter(c: RGBColor) -> RGBColor {
    let half = |x: u8| ((x as u16 + 255) / 2) as u8;
    RGBColor(half(c.0), half(c.1), half(c.2))
}
