//! The results table: one row per measurement, its percentiles, its goal and its
//! baseline.

use std::time::Duration;

/// One line of the table.
pub(crate) struct Row {
    name: String,
    /// Samples, for percentiles; empty for a row with a single figure.
    samples: Vec<Duration>,
    /// The figure of a row without samples (throughput, memory), with its unit.
    figure: Option<String>,
    goal: String,
    baseline: String,
    /// The row's figure depends on CPU left idle between its samples (a pool refilling in
    /// the background): on a busier or slower host it is worse for that reason alone.
    needs_idle_cpu: bool,
}

impl Row {
    pub(crate) fn timed(name: &str, samples: Vec<Duration>, goal: &str, baseline: &str) -> Row {
        Row {
            name: name.into(),
            samples,
            figure: None,
            goal: goal.into(),
            baseline: baseline.into(),
            needs_idle_cpu: false,
        }
    }

    pub(crate) fn figure(name: &str, figure: String, goal: &str, baseline: &str) -> Row {
        Row {
            name: name.into(),
            samples: Vec::new(),
            figure: Some(figure),
            goal: goal.into(),
            baseline: baseline.into(),
            needs_idle_cpu: false,
        }
    }
}

impl Row {
    /// Marks the row as depending on idle CPU (see [`Row::needs_idle_cpu`]).
    pub(crate) fn on_idle_cpu(mut self) -> Row {
        self.needs_idle_cpu = true;
        self
    }

    /// The name as printed: marked when the row depends on idle CPU.
    fn shown_name(&self) -> String {
        if self.needs_idle_cpu {
            format!("{} [idle CPU]", self.name)
        } else {
            self.name.clone()
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

pub(crate) fn summary(samples: &[Duration]) -> (f64, f64, f64) {
    let mut sorted = samples.to_vec();
    sorted.sort();
    (
        percentile(&sorted, 50.0),
        percentile(&sorted, 90.0),
        percentile(&sorted, 99.0),
    )
}

pub(crate) fn p50(samples: &[Duration]) -> f64 {
    summary(samples).0
}

/// Prints the table of `rows`, then the `notes` under it.
pub(crate) fn print(rows: &[Row], notes: &[String]) {
    println!();
    println!(
        "| {:<50} | {:>5} | {:>9} | {:>9} | {:>9} | {:<22} | baseline",
        "benchmark", "n", "p50 ms", "p90 ms", "p99 ms", "goal"
    );
    println!(
        "|{}|{}|{}|{}|{}|{}|---",
        "-".repeat(52),
        "-".repeat(7),
        "-".repeat(11),
        "-".repeat(11),
        "-".repeat(11),
        "-".repeat(24)
    );
    for row in rows {
        if let Some(figure) = &row.figure {
            println!(
                "| {:<50} | {:>5} | {:>33} | {:<22} | {}",
                row.shown_name(),
                "",
                figure,
                row.goal,
                row.baseline
            );
        } else {
            let (p50, p90, p99) = summary(&row.samples);
            println!(
                "| {:<50} | {:>5} | {:>9.2} | {:>9.2} | {:>9.2} | {:<22} | {}",
                row.shown_name(),
                row.samples.len(),
                p50,
                p90,
                p99,
                row.goal,
                row.baseline
            );
        }
    }
    if rows.iter().any(|r| r.needs_idle_cpu) {
        println!(
            "[idle CPU]: the figure depends on CPU left idle between samples (the pool \
             refills in the background); on a busier or slower host it is worse for that \
             reason alone: read it with the host's load and CPU above."
        );
    }
    for note in notes {
        println!("{note}");
    }
}
