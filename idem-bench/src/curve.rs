//! How throughput changes as the inbox grows (`--prefill` with several sizes): the medians at
//! each size, the table of them, and the curve drawn into a PNG.

use crate::report::{Sample, Table, median};
use anyhow::{Context as _, bail};
use std::path::Path;

/// Every consumer's runs at one inbox size.
pub struct Point {
    /// msgs/s, CPU and peak RSS, as the benchmark prints them.
    pub table: Table,
    /// Write-ahead log bytes per message, per run, per consumer.
    wal_per_message: Vec<Vec<f64>>,
    /// Expired rows deleted per second of the run, per run, per consumer (sweeping runs).
    swept_per_second: Vec<Vec<f64>>,
}

impl Point {
    /// No runs yet, of these consumers.
    pub fn new(names: Vec<&'static str>) -> Self {
        let consumers = names.len();
        Self {
            table: Table::new(names),
            wal_per_message: vec![Vec::new(); consumers],
            swept_per_second: vec![Vec::new(); consumers],
        }
    }

    /// A run of consumer `column`: its sample, the WAL it wrote and the expired rows deleted
    /// while it ran.
    pub fn add(&mut self, column: usize, sample: Sample, wal: u64, swept: u64, messages: usize) {
        self.wal_per_message[column].push(wal as f64 / messages as f64);
        self.swept_per_second[column].push(swept as f64 / sample.elapsed.as_secs_f64());
        self.table.add(column, sample);
    }
}

/// The medians of every consumer at every size.
pub struct Curve {
    names: Vec<&'static str>,
    /// (inbox rows, sweeping, per consumer: msgs/s, peak RSS MiB, WAL B/msg, rows swept/s).
    points: Vec<(u64, bool, Vec<[f64; 4]>)>,
    /// idem's sweeper alone: rows deleted per second.
    pub sweeper_alone: Option<f64>,
}

impl Curve {
    /// An empty curve of these consumers.
    pub fn new(names: Vec<&'static str>) -> Self {
        Self {
            names,
            points: Vec::new(),
            sweeper_alone: None,
        }
    }

    /// The runs at `rows` prefilled rows (`sweeping`: with the sweepers at work).
    pub fn add(&mut self, rows: u64, sweeping: bool, point: Point, messages: usize) {
        let messages_of = |column: usize| {
            let (rate, rss) = point.table.medians(column, messages);
            [
                rate,
                rss,
                median(point.wal_per_message[column].clone()),
                median(point.swept_per_second[column].clone()),
            ]
        };
        let medians = (0..self.names.len()).map(messages_of).collect();
        self.points.push((rows, sweeping, medians));
    }

    /// Every consumer's median msgs/s at the first size measured.
    pub fn first_rates(&self) -> Vec<f64> {
        self.points
            .first()
            .map(|(_, _, medians)| medians.iter().map(|m| m[0]).collect())
            .unwrap_or_default()
    }

    /// The table of medians: msgs/s at each size, and each as a share of the consumer's own
    /// figure with an empty inbox (the first size).
    pub fn render(&self) -> String {
        let mut out = String::from("| inbox rows |");
        for name in &self.names {
            out.push_str(&format!(
                " {name}: msgs/s (× empty) | WAL B/msg | peak RSS MiB |"
            ));
        }
        out.push_str(" rows swept/s |\n|---:|");
        out.push_str(&"---:|---:|---:|".repeat(self.names.len()));
        out.push_str("---:|\n");
        let first = self.points.first();
        for (rows, sweeping, medians) in &self.points {
            out.push_str(&format!(
                "| {}{} |",
                millions(*rows),
                if *sweeping { ", sweeper deleting" } else { "" }
            ));
            for (column, [rate, rss, wal, _]) in medians.iter().enumerate() {
                let base = first.map(|(_, _, m)| m[column][0]).unwrap_or(f64::NAN);
                out.push_str(&format!(
                    " {rate:.0} ({:.2}) | {wal:.0} | {rss:.1} |",
                    rate / base
                ));
            }
            let swept: Vec<String> = medians
                .iter()
                .filter(|m| *sweeping && m[3].is_finite())
                .map(|m| format!("{:.0}", m[3]))
                .collect();
            out.push_str(&format!(" {} |\n", swept.join(" / ")));
        }
        if let Some(rate) = self.sweeper_alone {
            out.push_str(&format!(
                "\nidem's sweeper alone: {rate:.0} expired rows deleted per second\n"
            ));
        }
        out
    }

    /// Draws msgs/s against inbox rows, one line per consumer; the sweeping runs are crosses.
    pub fn plot(&self, path: &Path) -> anyhow::Result<()> {
        use plotters::prelude::*;
        register_font()?;
        let drawn = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("drawing the curve: {e:?}");
        let top_rows = self.points.iter().map(|p| p.0).max().unwrap_or(1).max(1) as f64 / 1e6;
        let top_rate = self
            .points
            .iter()
            .flat_map(|p| p.2.iter().map(|m| m[0]))
            .filter(|r| r.is_finite())
            .fold(0.0, f64::max)
            * 1.15;
        let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(drawn)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Throughput as the inbox grows (PostgreSQL)",
                ("sans-serif", 24),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..top_rows * 1.05, 0.0..top_rate.max(1.0))
            .map_err(drawn)?;
        chart
            .configure_mesh()
            .x_desc("rows in the inbox (millions); crosses: a day's worth expired, the sweepers deleting")
            .y_desc("messages per second")
            .x_label_formatter(&|v| format!("{v}"))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(drawn)?;
        for (column, name) in self.names.iter().enumerate() {
            let color = Palette99::pick(column).to_rgba();
            let line: Vec<(f64, f64)> = self
                .points
                .iter()
                .filter(|p| !p.1)
                .map(|p| (p.0 as f64 / 1e6, p.2[column][0]))
                .collect();
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                .map_err(drawn)?
                .label(*name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart
                .draw_series(
                    line.iter()
                        .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
                )
                .map_err(drawn)?;
            let swept =
                self.points.iter().filter(|p| p.1).map(|p| {
                    Cross::new((p.0 as f64 / 1e6, p.2[column][0]), 7, color.stroke_width(3))
                });
            chart.draw_series(swept).map_err(drawn)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(drawn)?;
        root.present().map_err(drawn)?;
        Ok(())
    }
}

/// `12.5M`, `1M`, `0`.
fn millions(rows: u64) -> String {
    match rows {
        0 => "0".to_owned(),
        _ => format!("{}M", rows as f64 / 1e6),
    }
}

/// Fonts looked for, in order: the plot's text needs one TrueType font of the system.
const FONTS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers the first of [`FONTS`] found as `sans-serif`.
fn register_font() -> anyhow::Result<()> {
    let Some(bytes) = FONTS.iter().find_map(|path| std::fs::read(path).ok()) else {
        bail!(
            "no font to label the plot with: install DejaVu Sans (Debian: fonts-dejavu-core), looked for {FONTS:?}"
        );
    };
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("the font found is not a TrueType font"))
        .context("registering the plot's font")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn point(rates: [u64; 2]) -> Point {
        let mut point = Point::new(vec!["idem", "hand"]);
        for (column, rate) in rates.into_iter().enumerate() {
            let sample = Sample {
                elapsed: Duration::from_secs_f64(1_000.0 / rate as f64),
                rss_kib: 20 * 1024,
                cpu: Duration::from_millis(100),
            };
            point.add(column, sample, 2_000_000, 500, 1_000);
        }
        point
    }

    #[test]
    fn the_table_gives_each_size_as_a_share_of_the_empty_inbox() {
        let mut curve = Curve::new(vec!["idem", "hand"]);
        curve.add(0, false, point([1_000, 800]), 1_000);
        curve.add(10_000_000, false, point([900, 400]), 1_000);
        curve.add(10_000_000, true, point([850, 380]), 1_000);
        let table = curve.render();
        assert!(
            table.contains("| 10M | 900 (0.90) | 2000 | 20.0 | 400 (0.50) |"),
            "{table}"
        );
        assert!(
            table.contains("| 10M, sweeper deleting | 850 (0.85) |"),
            "{table}"
        );
    }

    /// With a font on the machine the curve is a PNG; without one, the error names the package.
    #[test]
    fn the_plot_is_a_png_or_names_the_missing_font() {
        let mut curve = Curve::new(vec!["idem", "hand"]);
        curve.add(0, false, point([1_000, 800]), 1_000);
        curve.add(1_000_000, false, point([950, 700]), 1_000);
        curve.add(1_000_000, true, point([900, 650]), 1_000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("curve.png");
        let drawn = curve.plot(&path);
        if !FONTS.iter().any(|font| Path::new(font).exists()) {
            let error = format!("{:#}", drawn.unwrap_err());
            assert!(error.contains("fonts-dejavu-core"), "{error}");
            return;
        }
        drawn.unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
        assert!(bytes.len() > 10_000, "{} bytes", bytes.len());
    }
}
