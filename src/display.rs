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

/// The bar of a phase named `name` (12 columns at most: "warm start", "RL (sync)", "eval
/// halfway") drawn on `target`: the bar, the count and the time take 51 columns, which leaves
/// a status of 29 on an 80-column terminal.
fn bar(name: &str, total: u64, target: ProgressDrawTarget) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), target);
    let style = ProgressStyle::with_template(
        "{prefix:>12.bold} [{bar:18.cyan/blue}] {pos}/{len} {elapsed:>6} {wide_msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(name.to_string());
    bar
}

impl Phase {
    pub fn new(mode: DisplayMode, name: &str, total: u64) -> Self {
        let inner = match mode {
            DisplayMode::Bar => {
                let bar = bar(name, total, ProgressDrawTarget::stderr());
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
        self.update_with(pos, message, message);
    }

    /// Progress with a `short` status for the bar (29 columns fit beside it on an 80-column
    /// terminal) and a `long` one for log lines.
    pub fn update_with(&mut self, pos: u64, short: &str, long: &str) {
        let message = long;
        match &mut self.inner {
            PhaseInner::Bar(bar) => {
                bar.set_position(pos);
                bar.set_message(short.to_string());
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

#[cfg(test)]
mod tests {
    use super::*;
    use indicatif::TermLike;
    use std::sync::{Arc, Mutex};

    /// An 80-column terminal that keeps what is written to it.
    #[derive(Debug, Clone, Default)]
    struct Screen(Arc<Mutex<Vec<String>>>);

    impl TermLike for Screen {
        fn width(&self) -> u16 {
            80
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            if let Ok(mut lines) = self.0.lock() {
                lines.push(s.to_string());
            }
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Text without ANSI escape sequences.
    fn plain(s: &str) -> String {
        let mut out = String::new();
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                for d in chars.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    }

    /// The longest phase name and the widest counts leave the whole status readable at 80
    /// columns.
    #[test]
    fn a_bar_and_its_status_fit_80_columns() {
        let screen = Screen::default();
        let b = bar(
            "eval halfway",
            2000,
            ProgressDrawTarget::term_like(Box::new(screen.clone())),
        );
        b.set_position(1999);
        b.set_message("reward 0.531 acc 50% v1999");
        b.tick();
        let lines = screen.0.lock().unwrap().clone();
        let drawn: Vec<String> = lines
            .iter()
            .map(|l| plain(l))
            .filter(|l| !l.trim().is_empty())
            .collect();
        assert!(!drawn.is_empty(), "nothing drawn");
        for line in &drawn {
            assert!(
                line.chars().count() <= 80,
                "{} columns: {line:?}",
                line.chars().count()
            );
        }
        assert!(
            drawn
                .iter()
                .any(|l| l.contains("eval halfway") && l.contains("reward 0.531 acc 50% v1999")),
            "{drawn:?}"
        );
    }
}
