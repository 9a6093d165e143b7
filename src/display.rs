//! Progress display for long commands: a live bar on a terminal, plain periodic log lines
//! when stderr is a file or a pipe (CI, `nohup`), nothing in tests.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DisplayMode {
    /// Bars redrawn in place on stderr.
    Bar,
    /// One log line per `every`, and one at the end of each phase.
    Log { every: Duration },
    /// Nothing.
    Quiet,
}

impl DisplayMode {
    /// A bar on a terminal, a log line every 5 s otherwise.
    pub fn auto() -> Self {
        if std::io::stderr().is_terminal() {
            DisplayMode::Bar
        } else {
            DisplayMode::Log {
                every: Duration::from_secs(5),
            }
        }
    }
}

/// One phase of work with a known length (warm-start steps, RL steps).
pub struct Phase {
    name: String,
    total: u64,
    inner: PhaseInner,
}

enum PhaseInner {
    Bar(ProgressBar),
    Log {
        every: Duration,
        last: Option<Instant>,
        started: Instant,
    },
    Quiet,
}

impl Phase {
    pub fn new(mode: DisplayMode, name: &str, total: u64) -> Self {
        let inner = match mode {
            DisplayMode::Bar => {
                let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
                let style = ProgressStyle::with_template(
                    "{prefix:>9.bold} [{bar:30.cyan/blue}] {pos}/{len} {elapsed_precise} (eta {eta}) {wide_msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
                bar.set_style(style);
                bar.set_prefix(name.to_string());
                bar.enable_steady_tick(Duration::from_millis(200));
                PhaseInner::Bar(bar)
            }
            DisplayMode::Log { every } => PhaseInner::Log {
                every,
                last: None,
                started: Instant::now(),
            },
            DisplayMode::Quiet => PhaseInner::Quiet,
        };
        Phase {
            name: name.to_string(),
            total,
            inner,
        }
    }

    /// Progress `pos` of `total`, with a one-line status.
    pub fn update(&mut self, pos: u64, message: &str) {
        match &mut self.inner {
            PhaseInner::Bar(bar) => {
                bar.set_position(pos);
                bar.set_message(message.to_string());
            }
            PhaseInner::Log {
                every,
                last,
                started,
            } => {
                if last.is_none_or(|t| t.elapsed() >= *every) {
                    *last = Some(Instant::now());
                    eprintln!(
                        "{} {pos}/{} [{:.0}s] {message}",
                        self.name,
                        self.total,
                        started.elapsed().as_secs_f64()
                    );
                }
            }
            PhaseInner::Quiet => {}
        }
    }

    /// A line above the bar (or in the log), e.g. a warning.
    pub fn println(&self, line: &str) {
        match &self.inner {
            PhaseInner::Bar(bar) => bar.println(line),
            PhaseInner::Log { .. } => eprintln!("{line}"),
            PhaseInner::Quiet => {}
        }
    }

    /// Ends the phase with a final status line.
    pub fn finish(self, message: &str) {
        match self.inner {
            PhaseInner::Bar(bar) => bar.finish_with_message(message.to_string()),
            PhaseInner::Log { started, .. } => eprintln!(
                "{} done in {:.1}s: {message}",
                self.name,
                started.elapsed().as_secs_f64()
            ),
            PhaseInner::Quiet => {}
        }
    }
}
