//! What roccl-perf prints and writes: nccl-tests' table (out of place and in place side by
//! side), its closing lines, and the same in JSON.

use serde::Serialize;

/// Statistics of the per-iteration times (us).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Stats {
    /// The median: the table's time.
    pub time_us: f64,
    pub mean_us: f64,
    pub min_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl Stats {
    pub fn of(times: &[f64]) -> Stats {
        let mut t = times.to_vec();
        t.sort_by(|a, b| a.total_cmp(b));
        let len = t.len().max(1);
        let at = |i: usize| t.get(i.min(len - 1)).copied().unwrap_or(0.0);
        Stats {
            time_us: at(t.len() / 2),
            mean_us: t.iter().sum::<f64>() / len as f64,
            min_us: at(0),
            p99_us: at((len * 99).div_ceil(100).saturating_sub(1)),
            max_us: at(len - 1),
        }
    }
}

/// One result: a collective at one size, data type, reduction and placement.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub op: &'static str,
    pub bytes: usize,
    pub count: usize,
    pub dtype: String,
    pub redop: String,
    pub root: i64,
    pub algo: String,
    pub net: String,
    pub ranks: usize,
    pub inplace: bool,
    pub blocking: bool,
    pub iters: usize,
    #[serde(flatten)]
    pub stats: Stats,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
    /// Wrong results over ranks; null when checking is off.
    pub wrong: Option<u64>,
}

/// Everything a run prints, for `--json`.
#[derive(Serialize)]
pub struct Doc {
    pub tool: &'static str,
    pub version: &'static str,
    pub header: Header,
    pub results: Vec<Row>,
    /// Null when checking is off.
    pub wrong_total: Option<u64>,
    pub avg_busbw_gbs: f64,
}

/// The run's settings, as its header prints them.
#[derive(Serialize)]
pub struct Header {
    pub ranks: usize,
    pub net: String,
    pub device: Option<String>,
    pub ops: Vec<String>,
    pub dtypes: Vec<String>,
    pub redops: Vec<String>,
    pub algo: String,
    pub minbytes: String,
    pub maxbytes: String,
    pub step: String,
    pub iters: usize,
    pub warmup: usize,
    pub check: u32,
    pub blocking: bool,
    pub average: u8,
    pub timeout_s: f64,
    pub cycles: usize,
}

/// nccl-tests' "Avg bus bandwidth": the mean busbw of every result that moves data.
pub fn avg_busbw(rows: &[Row]) -> f64 {
    let bw: Vec<f64> = rows
        .iter()
        .filter(|r| r.bytes > 0)
        .map(|r| r.busbw_gbs)
        .collect();
    if bw.is_empty() {
        0.0
    } else {
        bw.iter().sum::<f64>() / bw.len() as f64
    }
}

/// Widths of the leading columns: op, size, count, type, redop, root, algo.
const LEAD: [usize; 7] = [16, 12, 12, 6, 6, 5, 9];
/// Widths of a placement's columns: time, algbw, busbw, #wrong (then min, p99, max).
const GROUP: [usize; 4] = [11, 9, 9, 7];
const STATS: [usize; 3] = [10, 10, 10];

/// The table's layout: with or without the statistics columns.
pub struct Table {
    pub stats: bool,
}

impl Table {
    fn widths(&self) -> Vec<usize> {
        let mut group = GROUP.to_vec();
        if self.stats {
            group.extend(STATS);
        }
        LEAD.iter().chain(&group).chain(&group).copied().collect()
    }

    /// One row, each cell right-aligned in its column.
    pub fn line<S: AsRef<str>>(&self, cells: &[S]) -> String {
        cells
            .iter()
            .zip(self.widths())
            .map(|(c, w)| format!("{:>w$}", c.as_ref()))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// A header row: a table row whose first character is `#`.
    fn header_line(&self, cells: &[&str]) -> String {
        let mut l = self.line(cells);
        l.replace_range(..1, "#");
        l.trim_end().to_string()
    }

    /// The three header lines: placements, names, units.
    pub fn header(&self) -> Vec<String> {
        let lead: usize = LEAD.iter().map(|w| w + 1).sum();
        let group: usize = self.widths()[LEAD.len()..]
            .iter()
            .map(|w| w + 1)
            .sum::<usize>()
            / 2;
        let mut names = vec!["op", "size", "count", "type", "redop", "root", "algo"];
        let mut units = vec!["", "(B)", "(elements)", "", "", "", ""];
        for _ in 0..2 {
            names.extend(["time", "algbw", "busbw", "#wrong"]);
            units.extend(["(us)", "(GB/s)", "(GB/s)", ""]);
            if self.stats {
                names.extend(["min", "p99", "max"]);
                units.extend(["(us)", "(us)", "(us)"]);
            }
        }
        vec![
            format!(
                "#{:lead$}{:^group$}{:^group$}",
                "", "out-of-place", "in-place"
            )
            .trim_end()
            .to_string(),
            self.header_line(&names),
            self.header_line(&units),
        ]
    }

    /// The line of one size: its out-of-place and in-place results (either may be absent).
    pub fn row(&self, out: Option<&Row>, inp: Option<&Row>) -> String {
        let r = out.or(inp).expect("a result to print");
        let mut cells = vec![
            r.op.to_string(),
            r.bytes.to_string(),
            r.count.to_string(),
            r.dtype.clone(),
            r.redop.clone(),
            r.root.to_string(),
            r.algo.clone(),
        ];
        for g in [out, inp] {
            match g {
                Some(g) => {
                    cells.extend([
                        format!("{:.2}", g.stats.time_us),
                        format!("{:.3}", g.algbw_gbs),
                        format!("{:.3}", g.busbw_gbs),
                        g.wrong.map_or("N/A".into(), |w| w.to_string()),
                    ]);
                    if self.stats {
                        cells.extend([
                            format!("{:.2}", g.stats.min_us),
                            format!("{:.2}", g.stats.p99_us),
                            format!("{:.2}", g.stats.max_us),
                        ]);
                    }
                }
                None => {
                    let n = if self.stats { 7 } else { 4 };
                    cells.extend(vec!["-".to_string(); n]);
                }
            }
        }
        self.line(&cells)
    }
}

/// The closing lines: wrong results, nccl-tests' out-of-bounds line and average bus bandwidth.
pub fn closing(rows: &[Row], checked: bool) -> Vec<String> {
    let total: u64 = rows.iter().filter_map(|r| r.wrong).sum();
    let mut v = Vec::new();
    if checked {
        let bad = if total == 0 { "" } else { "  <-- FAILED" };
        v.push(format!("# wrong results: {total}{bad}"));
        v.push(format!(
            "# Out of bounds values : {total} {}",
            if total == 0 { "OK" } else { "FAILED" }
        ));
    } else {
        v.push("# wrong results: N/A (checking off: -c 0)".into());
    }
    v.push(format!("# Avg bus bandwidth    : {:.4}", avg_busbw(rows)));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_of_times() {
        let t: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Stats::of(&t);
        assert_eq!(
            (s.min_us, s.max_us, s.p99_us, s.time_us),
            (1.0, 100.0, 99.0, 51.0)
        );
        assert_eq!(s.mean_us, 50.5);
        let one = Stats::of(&[7.0]);
        assert_eq!(
            (one.min_us, one.p99_us, one.max_us, one.time_us),
            (7.0, 7.0, 7.0, 7.0)
        );
    }
}
