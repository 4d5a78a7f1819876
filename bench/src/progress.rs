//! The progress display on stderr (an indicatif bar, hidden unless enabled); notes go above it.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress bar on stderr (hidden unless enabled); notes go above it.
#[derive(Clone)]
pub(crate) struct Progress {
    bar: ProgressBar,
    enabled: bool,
}

impl Progress {
    pub(crate) fn new(enabled: bool) -> Self {
        let bar = ProgressBar::with_draw_target(
            Some(0),
            if enabled {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} {prefix:<22} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}",
            )
            .expect("valid template"),
        );
        bar.set_prefix("declaring");
        if enabled {
            bar.enable_steady_tick(Duration::from_millis(200));
        }
        Progress { bar, enabled }
    }
    /// The bar itself, for a task that keeps its position up to date.
    pub(crate) fn bar(&self) -> &ProgressBar {
        &self.bar
    }
    pub(crate) fn phase(&self, name: &str, total: u64) {
        self.bar.set_prefix(name.to_string());
        self.bar.set_position(0);
        self.bar.set_length(total);
        self.bar.set_message("");
        self.bar.reset_elapsed();
    }
    pub(crate) fn note(&self, line: &str) {
        if self.enabled {
            self.bar.println(line);
        } else {
            eprintln!("{line}");
        }
    }
    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
