//! `roccl-perf --plot OUT.svg RUN.json...`: latency (log-log) and bus bandwidth against size,
//! one line per run and collective, drawn by hand as SVG.
//!
//! A run is a `--json` file of roccl-perf (or any JSON of the same shape: an object with
//! `results`, or an array of rows, each with `op`, `bytes`, `time_us` and `busbw_gbs`, so
//! that a peer's figures can be drawn beside roccl's). Its label is `FILE=LABEL`'s, else
//! the file's top-level `label`, else "NET OP, N ranks".

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::Value;

/// One line of the chart.
pub struct Series {
    pub label: String,
    /// (bytes, time in us, bus bandwidth in GB/s), by size.
    pub points: Vec<(f64, f64, f64)>,
}

/// The series of one JSON file (one per collective), labelled `label` when given.
pub fn load(path: &str, label: Option<&str>) -> Result<Vec<Series>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
    let doc: Value = serde_json::from_str(&text).map_err(|e| format!("{path}: not JSON: {e}"))?;
    let rows = match &doc {
        Value::Array(a) => a.as_slice(),
        Value::Object(o) => match o.get("results") {
            Some(Value::Array(a)) => a.as_slice(),
            _ => return Err(format!("{path}: no \"results\" array")),
        },
        _ => return Err(format!("{path}: expected an object or an array of results")),
    };
    let own = doc.get("label").and_then(Value::as_str);
    let prefer_out = rows
        .iter()
        .any(|r| r.get("inplace") != Some(&Value::Bool(true)));
    let first = |k: &str| rows.first().and_then(|r| r.get(k)).cloned();
    let (dtype, redop) = (first("dtype"), first("redop"));
    // Per collective, per size: the times and bandwidths of that size's results.
    let mut by_op: BTreeMap<String, BTreeMap<u64, Vec<(f64, f64)>>> = BTreeMap::new();
    let mut order = Vec::new();
    for r in rows {
        let inplace = r.get("inplace") == Some(&Value::Bool(true));
        if (prefer_out && inplace)
            || (dtype.is_some() && r.get("dtype") != dtype.as_ref())
            || (r.get("redop").is_some_and(|v| v != "none") && r.get("redop") != redop.as_ref())
        {
            continue;
        }
        let (Some(op), Some(bytes), Some(t), Some(bw)) = (
            r.get("op").and_then(Value::as_str),
            r.get("bytes").and_then(Value::as_u64),
            r.get("time_us").and_then(Value::as_f64),
            r.get("busbw_gbs").and_then(Value::as_f64),
        ) else {
            return Err(format!(
                "{path}: a result without op, bytes, time_us and busbw_gbs: {r}"
            ));
        };
        if bytes == 0 || t <= 0.0 {
            continue;
        }
        if !by_op.contains_key(op) {
            order.push(op.to_string());
        }
        by_op
            .entry(op.to_string())
            .or_default()
            .entry(bytes)
            .or_default()
            .push((t, bw));
    }
    let net = first("net").and_then(|v| v.as_str().map(String::from));
    let ranks = first("ranks").and_then(|v| v.as_u64());
    let many = order.len() > 1;
    let series: Vec<Series> = order
        .iter()
        .map(|op| {
            let label = match (label.or(own), many) {
                (Some(l), false) => l.to_string(),
                (Some(l), true) => format!("{l} {op}"),
                (None, _) => {
                    let mut l = format!("{} {op}", net.as_deref().unwrap_or(path));
                    if let Some(n) = ranks {
                        l = format!("{l}, {n} ranks");
                    }
                    l
                }
            };
            let points = by_op[op]
                .iter()
                .map(|(&b, v)| {
                    (
                        b as f64,
                        median(v.iter().map(|p| p.0)),
                        median(v.iter().map(|p| p.1)),
                    )
                })
                .collect();
            Series { label, points }
        })
        .collect();
    if series.is_empty() {
        return Err(format!("{path}: no result with a size above 0 to plot"));
    }
    Ok(series)
}

fn median(it: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = it.collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `--plot OUT FILE[=LABEL]...`: read the runs and write the chart.
pub fn plot(out: &str, files: &[String]) -> Result<(), String> {
    if files.is_empty() {
        return Err("--plot OUT.svg needs one or more --json files of runs after it".into());
    }
    if !out.to_ascii_lowercase().ends_with(".svg") {
        return Err(format!(
            "--plot {out}: the chart is SVG: name it .svg (for a PNG: rsvg-convert OUT.svg -o OUT.png)"
        ));
    }
    let mut series = Vec::new();
    for f in files {
        let (path, label) = match f.split_once('=') {
            Some((p, l)) if !std::path::Path::new(f).exists() => (p, Some(l)),
            _ => (f.as_str(), None),
        };
        series.extend(load(path, label)?);
    }
    std::fs::write(out, svg(&series)).map_err(|e| format!("writing {out}: {e}"))
}

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];
const W: f64 = 1000.0;
const PANEL_W: f64 = 400.0;
const PANEL_H: f64 = 300.0;
const TOP: f64 = 50.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Bytes as the table's sizes are given: 8, 64K, 16M.
fn size_text(b: f64) -> String {
    let b = b as u64;
    match b {
        _ if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        _ if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        _ if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        _ => b.to_string(),
    }
}

/// One panel: axes, ticks, and a polyline per series of the values `y` picks.
struct Panel<'a> {
    x0: f64,
    title: &'a str,
    ylabel: &'a str,
    ylog: bool,
}

impl Panel<'_> {
    fn draw(&self, s: &mut String, series: &[Series], y: impl Fn(&(f64, f64, f64)) -> f64) {
        let all = || series.iter().flat_map(|r| r.points.iter());
        let (xmin, xmax) = all().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (lxmin, lxmax) = (
            xmin.log2().floor(),
            xmax.log2().ceil().max(xmin.log2().floor() + 1.0),
        );
        let ys: Vec<f64> = all().map(&y).filter(|v| v.is_finite()).collect();
        let ymax = ys.iter().copied().fold(0.0, f64::max);
        let (ya, yb) = if self.ylog {
            let ymin = ys
                .iter()
                .copied()
                .filter(|v| *v > 0.0)
                .fold(f64::MAX, f64::min);
            let lo = ymin.min(ymax).max(1e-3).log10().floor();
            (lo, ymax.max(1e-3).log10().ceil().max(lo + 1.0))
        } else {
            (0.0, nice(ymax.max(1e-9) * 1.05))
        };
        let (x0, y0) = (self.x0, TOP);
        let px = |b: f64| x0 + (b.log2() - lxmin) / (lxmax - lxmin) * PANEL_W;
        let py = |v: f64| {
            let f = if self.ylog {
                (v.max(1e-9).log10() - ya) / (yb - ya)
            } else {
                (v - ya) / (yb - ya)
            };
            y0 + PANEL_H - f * PANEL_H
        };
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"##,
            x0 + PANEL_W / 2.0,
            y0 - 12.0,
            esc(self.title)
        );
        let _ = writeln!(
            s,
            r##"<rect x="{x0}" y="{y0}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#333"/>"##
        );
        // X ticks: powers of two, at most 9 labels.
        let span = (lxmax - lxmin) as usize;
        let every = span.div_ceil(8).max(1);
        for k in (0..=span).step_by(every) {
            let b = 2f64.powi((lxmin as i32) + k as i32);
            let x = px(b);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle" font-size="11">{}</text>"##,
                y0 + PANEL_H,
                y0 + PANEL_H + 15.0,
                size_text(b)
            );
        }
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" text-anchor="middle" font-size="12">size (bytes)</text>"##,
            x0 + PANEL_W / 2.0,
            y0 + PANEL_H + 34.0
        );
        // Y ticks: powers of ten (log) or five steps.
        let ticks: Vec<f64> = if self.ylog {
            (ya as i32..=yb as i32).map(|e| 10f64.powi(e)).collect()
        } else {
            (0..=5).map(|i| yb * i as f64 / 5.0).collect()
        };
        for v in ticks {
            let yy = py(v);
            let _ = writeln!(
                s,
                r##"<line x1="{x0}" y1="{yy:.1}" x2="{}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end" font-size="11">{}</text>"##,
                x0 + PANEL_W,
                x0 - 5.0,
                yy + 4.0,
                num_text(v)
            );
        }
        let _ = writeln!(
            s,
            r##"<text transform="translate({},{}) rotate(-90)" text-anchor="middle" font-size="12">{}</text>"##,
            x0 - 45.0,
            y0 + PANEL_H / 2.0,
            esc(self.ylabel)
        );
        for (i, r) in series.iter().enumerate() {
            let pts: Vec<String> = r
                .points
                .iter()
                .map(|p| format!("{:.1},{:.1}", px(p.0), py(y(p))))
                .collect();
            let _ = writeln!(
                s,
                r##"<polyline class="series" data-label="{}" fill="none" stroke="{}" stroke-width="2" points="{}"/>"##,
                esc(&r.label),
                COLORS[i % COLORS.len()],
                pts.join(" ")
            );
            for p in &pts {
                let (cx, cy) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(
                    s,
                    r##"<circle cx="{cx}" cy="{cy}" r="2.5" fill="{}"/>"##,
                    COLORS[i % COLORS.len()]
                );
            }
        }
    }
}

/// The smallest of 1, 2 or 5 times a power of ten at or above `v`.
fn nice(v: f64) -> f64 {
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|x| *x >= v)
        .unwrap_or(10.0 * p)
}

fn num_text(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v >= 1.0 && v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// The chart: latency on the left, bus bandwidth on the right, the legend below.
pub fn svg(series: &[Series]) -> String {
    let legend_rows = series.len().div_ceil(2);
    let h = TOP + PANEL_H + 60.0 + 20.0 * legend_rows as f64 + 10.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif">
<rect width="100%" height="100%" fill="white"/>"##
    );
    Panel {
        x0: 80.0,
        title: "Latency (time per call)",
        ylabel: "time (us)",
        ylog: true,
    }
    .draw(&mut s, series, |p| p.1);
    Panel {
        x0: 80.0 + PANEL_W + 100.0,
        title: "Bus bandwidth",
        ylabel: "busbw (GB/s)",
        ylog: false,
    }
    .draw(&mut s, series, |p| p.2);
    let ly = TOP + PANEL_H + 60.0;
    for (i, r) in series.iter().enumerate() {
        let (x, y) = (80.0 + (i % 2) as f64 * 450.0, ly + 20.0 * (i / 2) as f64);
        let _ = writeln!(
            s,
            r##"<g class="legend"><line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="3"/><text x="{}" y="{}" font-size="13">{}</text></g>"##,
            x + 30.0,
            COLORS[i % COLORS.len()],
            x + 38.0,
            y + 4.0,
            esc(&r.label)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_numbers() {
        assert_eq!(size_text(8.0), "8");
        assert_eq!(size_text(65536.0), "64K");
        assert_eq!(size_text(64.0 * 1048576.0), "64M");
        assert_eq!(nice(3.2), 5.0);
        assert_eq!(nice(10.0), 10.0);
        assert_eq!(num_text(0.5), "0.5");
        assert_eq!(num_text(100.0), "100");
    }

    #[test]
    fn one_polyline_per_series() {
        let s = svg(&[
            Series {
                label: "a <b>".into(),
                points: vec![(8.0, 10.0, 0.1), (64.0, 12.0, 0.5)],
            },
            Series {
                label: "c".into(),
                points: vec![(8.0, 20.0, 0.05)],
            },
        ]);
        assert_eq!(s.matches("<polyline").count(), 4);
        assert!(s.contains("a &lt;b&gt;") && s.ends_with("</svg>\n"));
    }
}
