//! The bench's progress display, between the rows it prints.

use crate::report::Row;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// A progress bar per case (indicatif) when stderr is a terminal outside
/// CI; nothing otherwise, so logs and CI output hold only the rows.
pub(crate) struct Progress {
    shown: bool,
    total: usize,
    done: usize,
    bar: ProgressBar,
}

impl Progress {
    pub(crate) fn new(total: usize) -> Progress {
        Progress {
            shown: std::io::stderr().is_terminal() && std::env::var_os("CI").is_none(),
            total,
            done: 0,
            bar: ProgressBar::hidden(),
        }
    }

    pub(crate) fn replace(&mut self, bar: ProgressBar) {
        self.bar.finish_and_clear();
        self.bar = if self.shown {
            bar
        } else {
            ProgressBar::hidden()
        };
    }

    /// A new case of `rounds` rounds begins.
    pub(crate) fn case(&mut self, label: &str, rounds: usize) {
        self.done += 1;
        let style = ProgressStyle::with_template(
            "{prefix} {msg:26} [{bar:30.cyan/blue}] {pos}/{len} rounds {elapsed}",
        )
        .expect("a valid progress template")
        .progress_chars("=> ");
        let bar = ProgressBar::new(rounds as u64)
            .with_style(style)
            .with_prefix(format!("[{}/{}]", self.done, self.total))
            .with_message(label.to_string());
        self.replace(bar);
    }

    /// The case turned out to have `rounds` rounds.
    pub(crate) fn set_rounds(&self, rounds: usize) {
        self.bar.set_length(rounds as u64);
    }

    pub(crate) fn round_done(&self) {
        self.bar.inc(1);
    }

    /// Work between cases (the ceiling sweeps): a spinner.
    pub(crate) fn note(&mut self, label: &str) {
        let bar = ProgressBar::new_spinner()
            .with_prefix(format!("[{}/{}]", self.done, self.total))
            .with_message(label.to_string());
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        self.replace(bar);
    }

    pub(crate) fn row(&mut self, row: &Row) {
        self.bar.finish_and_clear();
        println!("{}", row.line());
    }

    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
