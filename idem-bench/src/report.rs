//! Samples, medians, ratios and the table the benchmark prints.

use anyhow::Context as _;
use std::time::Duration;

/// One run of one consumer.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// First handler call (or delivery) to last settlement.
    pub elapsed: Duration,
    /// The consumer process's peak resident set (VmHWM), KiB.
    pub rss_kib: u64,
    /// CPU time the consumer process used (user + system).
    pub cpu: Duration,
}

impl Sample {
    /// Messages per second, for a run of `messages`.
    pub fn rate(&self, messages: usize) -> f64 {
        messages as f64 / self.elapsed.as_secs_f64()
    }

    /// Reads `<elapsed µs> <peak RSS KiB> <CPU ms>`.
    pub fn parse(line: &str) -> anyhow::Result<Self> {
        let mut fields = line.split_whitespace().map(str::parse::<u64>);
        let micros = fields.next().context("no time")??;
        let rss_kib = fields.next().context("no RSS")??;
        let cpu_ms = fields.next().context("no CPU time")??;
        Ok(Self {
            elapsed: Duration::from_micros(micros),
            rss_kib,
            cpu: Duration::from_millis(cpu_ms),
        })
    }
}

/// CPU time (user + system) this process has used, from `/proc/self/stat`, in milliseconds
/// (assuming the usual 100 ticks per second).
pub fn cpu_ms() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may contain spaces).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) * 10)
}

/// This process's peak resident set size in KiB, from `/proc/self/status`.
pub fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Samples per consumer, in the order the consumers were given.
pub struct Table {
    names: Vec<&'static str>,
    samples: Vec<Vec<Sample>>,
}

/// Where a batch-mode consumer's batches spent their time, from a Prometheus scrape of its
/// metrics: their count and mean deliveries, then per batch on average the wait for the first
/// delivery, the fill, the claim, the handler and the commit.
pub fn batch_fill(scrape: &str) -> String {
    let value = |series: &str| {
        scrape
            .lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let batches = value("idem_batch_deliveries_count");
    let per_batch = |series: &str| value(series) / batches.max(1.0);
    let ms = |histogram: &str| per_batch(&format!("{histogram}_sum")) * 1000.0;
    format!(
        "batches {batches:.0}: {:.0} deliveries; per batch {:.2} ms waiting for the first \
         delivery, {:.2} filling, {:.2} claiming, {:.2} in the handler, {:.2} committing",
        per_batch("idem_batch_deliveries_sum"),
        ms("idem_batch_wait_seconds"),
        ms("idem_batch_fill_seconds"),
        ms("idem_claim_duration_seconds"),
        ms("idem_handler_duration_seconds"),
        ms("idem_commit_duration_seconds"),
    )
}

/// The median of `values` (NaN when there are none).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The lower quartile, median and upper quartile of `values` (each the median of its half, the
/// middle value left out of both halves when their number is odd).
fn quartiles(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let (lower, upper) = (&values[..n / 2], &values[n.div_ceil(2)..]);
    match n {
        0 => (f64::NAN, f64::NAN, f64::NAN),
        1 => (values[0], values[0], values[0]),
        _ => (
            median(lower.to_vec()),
            median(values.clone()),
            median(upper.to_vec()),
        ),
    }
}

impl Table {
    /// An empty table for these consumers.
    pub fn new(names: Vec<&'static str>) -> Self {
        let samples = vec![Vec::new(); names.len()];
        Self { names, samples }
    }

    /// Adds a sample of consumer `column`.
    pub fn add(&mut self, column: usize, sample: Sample) {
        self.samples[column].push(sample);
    }

    /// Consumer `column`'s median msgs/s and median peak RSS (MiB).
    pub fn medians(&self, column: usize, messages: usize) -> (f64, f64) {
        let samples = &self.samples[column];
        (
            median(samples.iter().map(|x| x.rate(messages)).collect()),
            median(samples.iter().map(|x| x.rss_kib as f64 / 1024.0).collect()),
        )
    }

    /// Consumer `column`'s msgs/s in each run divided by the first consumer's in the same run:
    /// the quartiles of those ratios. Pairing runs takes out what drifts from one run to the
    /// next (the broker's and the database's state), which the ratio of medians keeps.
    fn paired(&self, column: usize, messages: usize) -> (f64, f64, f64) {
        let first = self.samples.first().map(Vec::as_slice).unwrap_or_default();
        quartiles(
            self.samples[column]
                .iter()
                .zip(first)
                .map(|(x, base)| x.rate(messages) / base.rate(messages))
                .collect(),
        )
    }

    /// Medians of msgs/s and peak RSS, with ratios to the first two consumers (the handwritten
    /// per-message and batched ones, in the default order), and each consumer's per-run ratio
    /// to the first one (median, and its quartiles).
    pub fn render(&self, messages: usize) -> String {
        let rates: Vec<f64> = self
            .samples
            .iter()
            .map(|s| median(s.iter().map(|x| x.rate(messages)).collect()))
            .collect();
        let first = self.names.first().copied().unwrap_or("-");
        let mut out = format!(
            "| consumer | runs | msgs/s (median) | min–max | consumer CPU µs/msg | peak RSS MiB (median) | × {first} | × {} | × {first} in the same run (quartiles) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            self.names.get(1).copied().unwrap_or("-"),
        );
        for (i, name) in self.names.iter().enumerate() {
            let all: Vec<f64> = self.samples[i].iter().map(|x| x.rate(messages)).collect();
            let (lo, hi) = all.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &r| {
                (lo.min(r), hi.max(r))
            });
            let rss = median(
                self.samples[i]
                    .iter()
                    .map(|x| x.rss_kib as f64 / 1024.0)
                    .collect(),
            );
            let cpu = median(
                self.samples[i]
                    .iter()
                    .map(|x| x.cpu.as_secs_f64() * 1e6 / messages as f64)
                    .collect(),
            );
            let ratio = |j: usize| {
                rates
                    .get(j)
                    .map(|base| format!("{:.2}", rates[i] / base))
                    .unwrap_or_else(|| "-".to_owned())
            };
            let (q1, q2, q3) = self.paired(i, messages);
            out.push_str(&format!(
                "| {name} | {} | {:.0} | {lo:.0}–{hi:.0} | {cpu:.0} | {rss:.1} | {} | {} | {q2:.2} ({q1:.2}–{q3:.2}) |\n",
                all.len(),
                rates[i],
                ratio(0),
                ratio(1),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(millis: u64) -> Sample {
        Sample {
            elapsed: Duration::from_millis(millis),
            rss_kib: 1024,
            cpu: Duration::from_millis(1),
        }
    }

    #[test]
    fn quartiles_split_the_sorted_values_in_halves() {
        assert_eq!(quartiles(vec![4.0, 1.0, 3.0, 2.0]), (1.5, 2.5, 3.5));
        assert_eq!(quartiles(vec![5.0, 1.0, 3.0, 2.0, 4.0]), (1.5, 3.0, 4.5));
        assert_eq!(quartiles(vec![7.0]), (7.0, 7.0, 7.0));
        assert!(quartiles(Vec::new()).1.is_nan());
    }

    #[test]
    fn paired_ratios_compare_each_run_with_the_first_consumers_same_run() {
        let mut table = Table::new(vec!["hand", "idem"]);
        // The second run is 2.5 times as fast as the first for both consumers; idem is 0.8x
        // the first consumer in each.
        for (hand, idem) in [(1_000, 1_250), (400, 500)] {
            table.add(0, sample(hand));
            table.add(1, sample(idem));
        }
        let (q1, q2, q3) = table.paired(1, 1_000);
        for q in [q1, q2, q3] {
            assert!((q - 0.8).abs() < 1e-9, "{q}");
        }
        assert!(table.render(1_000).contains("| idem | 2 |"));
        assert!(table.render(1_000).contains("0.80 (0.80–0.80)"));
    }

    #[test]
    fn a_scrape_becomes_the_mean_time_of_each_step_per_batch() {
        let scrape = "idem_batch_deliveries_count{consumer=\"c\"} 4
idem_batch_deliveries_sum{consumer=\"c\"} 800
idem_batch_wait_seconds_sum{consumer=\"c\"} 0.008
idem_batch_fill_seconds_sum{consumer=\"c\"} 0.002
idem_claim_duration_seconds_sum{consumer=\"c\"} 0.006
idem_handler_duration_seconds_sum{consumer=\"c\"} 0.007
idem_commit_duration_seconds_sum{consumer=\"c\"} 0.0032
";
        assert_eq!(
            batch_fill(scrape),
            "batches 4: 200 deliveries; per batch 2.00 ms waiting for the first delivery, \
             0.50 filling, 1.50 claiming, 1.75 in the handler, 0.80 committing"
        );
    }
}
