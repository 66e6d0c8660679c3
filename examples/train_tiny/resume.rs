//! `--resume`: the metrics written before the checkpoint a run resumes from.

use std::path::Path;

use crate::plot::Row;

/// The lines of `metrics.csv` at `path` for the steps before `step` (the header `header` first)
/// and their plot rows. Rows the killed run wrote after its last checkpoint are dropped: the
/// resumed run trains those steps again.
pub(crate) fn metrics_before(
    path: &Path,
    header: &str,
    step: usize,
    moe_layers: usize,
) -> Result<(String, Vec<Row>), String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--resume: cannot read {}: {e}", path.display()))?;
    let mut lines = text.lines();
    if lines.next() != Some(header.trim_end()) {
        return Err(format!(
            "--resume: {} was written with other options (its header differs)",
            path.display()
        ));
    }
    let mut kept = header.to_string();
    let mut rows = Vec::new();
    for line in lines {
        let row = parse_row(line, moe_layers)
            .ok_or_else(|| format!("--resume: unreadable row in {}: {line}", path.display()))?;
        if row.step >= step {
            break;
        }
        kept.push_str(line);
        kept.push('\n');
        rows.push(row);
    }
    if rows.len() != step {
        return Err(format!(
            "--resume: {} holds {} rows before step {step}",
            path.display(),
            rows.len()
        ));
    }
    Ok((kept, rows))
}

/// One `metrics.csv` line: step, loss, accuracy, tokens/s, lr, then per MoE layer the max
/// violation and the dead experts, then per layer the window violation (further columns unread).
fn parse_row(line: &str, moe_layers: usize) -> Option<Row> {
    let cells: Vec<&str> = line.split(',').collect();
    let num = |i: usize| cells.get(i)?.parse::<f64>().ok();
    let load = (0..moe_layers)
        .map(|l| Some((num(5 + 2 * l)?, cells.get(6 + 2 * l)?.parse().ok()?)))
        .collect::<Option<Vec<_>>>()?;
    let window = (0..moe_layers)
        .map(|l| num(5 + 2 * moe_layers + l))
        .collect::<Option<Vec<_>>>()?;
    Some(Row {
        step: cells.first()?.parse().ok()?,
        loss: num(1)?,
        accuracy: num(2)?,
        load,
        window,
    })
}
