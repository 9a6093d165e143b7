//! Run reports: the per-step metrics as JSON lines and CSV, and the learning curve as SVG
//! (reward and accuracy against wall-clock time and against step).

use crate::schema::StepRecord;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Normal quantile of a two-sided 95% interval.
pub const Z95: f64 = 1.959_963_984_540_054;

/// A mean over independent draws with its standard error and 95% interval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Estimate {
    pub mean: f64,
    /// Standard error of the mean.
    pub se: f64,
    /// 95% interval (normal approximation).
    pub lo: f64,
    pub hi: f64,
    pub n: usize,
}

impl Estimate {
    /// The mean of `values` and its standard error (sample standard deviation / √n).
    pub fn of(values: &[f64]) -> Self {
        let n = values.len();
        if n == 0 {
            return Estimate::default();
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        let var = if n > 1 {
            values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64
        } else {
            0.0
        };
        Self::with_se(mean, (var / n as f64).sqrt(), n)
    }

    /// [`Estimate::of`] a rate (each value in [0, 1]: a pass, a call): its interval clipped
    /// to [0, 1], where the normal approximation can reach past either end.
    pub fn rate(values: &[f64]) -> Self {
        Self::of(values).within(0.0, 1.0)
    }

    /// The interval clipped to `[lo, hi]`, the range the quantity can take.
    pub fn within(mut self, lo: f64, hi: f64) -> Self {
        self.lo = self.lo.clamp(lo, hi);
        self.hi = self.hi.clamp(lo, hi);
        self
    }

    fn with_se(mean: f64, se: f64, n: usize) -> Self {
        Estimate {
            mean,
            se,
            lo: mean - Z95 * se,
            hi: mean + Z95 * se,
            n,
        }
    }

    /// `self − before`, for two evaluations on the same prompts with independent samples
    /// (the paired difference would be tighter; this one is conservative).
    pub fn minus(&self, before: &Estimate) -> Estimate {
        Self::with_se(
            self.mean - before.mean,
            self.se.hypot(before.se),
            self.n.min(before.n),
        )
    }

    /// `41.2% ± 1.9` (the half-width of the 95% interval), for rates.
    pub fn percent(&self) -> String {
        format!("{:.1}% ± {:.1}", 100.0 * self.mean, 100.0 * Z95 * self.se)
    }

    /// `0.612 ± 0.011`, for rewards.
    pub fn value(&self) -> String {
        format!("{:.3} ± {:.3}", self.mean, Z95 * self.se)
    }
}

/// A held-out evaluation marked on the learning curve: reward and pass@1 at the sampling
/// temperature, each drawn as its mean and 95% interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Marker {
    /// Trainer steps of the evaluated weights (0: before RL).
    pub step: u64,
    pub reward: Estimate,
    pub pass_at_1: Estimate,
}

/// One row of the run report: the trainer's step record and where the run stood.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    #[serde(flatten)]
    pub record: StepRecord,
    #[serde(flatten)]
    pub run: RunProgress,
}

/// Where the run stood when a step finished.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunProgress {
    /// Seconds since RL started.
    pub time_s: f64,
    /// Version the generator was decoding with when the step finished.
    pub gen_version: u64,
    /// Trained tokens per second since RL started.
    pub trained_tokens_per_s: f64,
    /// Entries waiting in (or delivered but unacked from) each stream.
    pub queue_prompts: u64,
    pub queue_rollouts: u64,
    pub queue_scored: u64,
}

/// Column order of the CSV: `step` and `time_s` first, then the rest of the step record's
/// fields and of the run's, as declared.
pub fn columns() -> Vec<&'static str> {
    const FIRST: [&str; 2] = ["step", "time_s"];
    let rest = field_names::<StepRecord>()
        .iter()
        .chain(field_names::<RunProgress>())
        .filter(|f| !FIRST.contains(f));
    FIRST.into_iter().chain(rest.copied()).collect()
}

/// The fields of a struct in declaration order, as its serde derive names them (read off
/// the `deserialize_struct` call, so the list cannot drift from the struct).
fn field_names<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
    use serde::de::{self, Visitor};
    struct Names<'a>(&'a mut &'static [&'static str]);
    impl<'de> de::Deserializer<'de> for Names<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("field names only"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("field names only"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut names: &'static [&'static str] = &[];
    let _ = T::deserialize(Names(&mut names));
    names
}

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("cannot write report file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot serialise the report: {0}")]
    Json(#[from] serde_json::Error),
}

/// Writes `text` to `path` aside (`{path}.partial`), then renames it into place: a write that
/// fails (a full disk, a file size limit) leaves the file a previous report wrote whole.
fn write(path: &Path, text: &str) -> Result<(), ReportError> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let io = |source| ReportError::Io {
        path: path.display().to_string(),
        source,
    };
    if let Err(e) = std::fs::write(&partial, text) {
        let _ = std::fs::remove_file(&partial);
        return Err(io(e));
    }
    std::fs::rename(&partial, path).map_err(io)
}

/// The files [`write_report`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportFiles {
    pub jsonl: PathBuf,
    pub csv: PathBuf,
    pub svg: PathBuf,
    pub summary: PathBuf,
}

/// Writes `metrics.jsonl`, `metrics.csv`, `learning_curve.svg` and `summary.json` in `dir`.
pub fn write_report(
    dir: &Path,
    rows: &[StepRow],
    held_out: &[Marker],
    summary: &impl Serialize,
    title: &str,
) -> Result<ReportFiles, ReportError> {
    std::fs::create_dir_all(dir).map_err(|source| ReportError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let files = ReportFiles {
        jsonl: dir.join("metrics.jsonl"),
        csv: dir.join("metrics.csv"),
        svg: dir.join("learning_curve.svg"),
        summary: dir.join("summary.json"),
    };
    let mut jsonl = String::new();
    for r in rows {
        jsonl.push_str(&serde_json::to_string(r)?);
        jsonl.push('\n');
    }
    write(&files.jsonl, &jsonl)?;
    write(&files.csv, &csv(rows)?)?;
    write(&files.svg, &learning_curve_svg(rows, held_out, title))?;
    write(&files.summary, &serde_json::to_string_pretty(summary)?)?;
    Ok(files)
}

/// The rows as CSV with a header, in [`columns`] order; counts print as integers and
/// flags as 0 or 1.
pub fn csv(rows: &[StepRow]) -> Result<String, ReportError> {
    let columns = columns();
    let mut out = columns.join(",");
    out.push('\n');
    for r in rows {
        let v = serde_json::to_value(r)?;
        let cells: Vec<String> = columns
            .iter()
            .map(|c| match &v[*c] {
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => u8::from(*b).to_string(),
                // A field the step did not measure (teacher_kl without a teacher).
                serde_json::Value::Null => String::new(),
                other => other.to_string(),
            })
            .collect();
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    Ok(out)
}

/// Mean of a trailing window, so a noisy per-step series reads as a curve.
pub fn moving_average(xs: &[f64], window: usize) -> Vec<f64> {
    let w = window.max(1);
    let mut out = Vec::with_capacity(xs.len());
    let mut sum = 0.0;
    for (i, &x) in xs.iter().enumerate() {
        sum += x;
        if i >= w {
            sum -= xs[i - w];
        }
        out.push(sum / (i + 1).min(w) as f64);
    }
    out
}

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 400.0;
const PANEL_W: f64 = 400.0;
const PANEL_H: f64 = 260.0;
const REWARD_COLOR: &str = "#1f77b4";
const ACCURACY_COLOR: &str = "#d62728";

/// Tick values covering [0, max]: 5 steps at a round size.
fn ticks(max: f64) -> Vec<f64> {
    if max <= 0.0 || !max.is_finite() {
        return vec![0.0];
    }
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    (0..)
        .map(|i| i as f64 * step)
        .take_while(|t| *t <= max + step * 1e-9)
        .collect()
}

fn fmt_tick(t: f64) -> String {
    if t.fract() == 0.0 {
        format!("{t:.0}")
    } else {
        format!("{t:.1}")
    }
}

/// One panel: reward and accuracy (raw faint, smoothed solid) against `xs`, and held-out
/// points (`x`, estimate, colour) as circles with their intervals.
fn panel(
    svg: &mut String,
    x0: f64,
    y0: f64,
    xs: &[f64],
    series: &[(&str, &str, Vec<f64>)],
    points: &[(f64, Estimate, &str)],
    xlabel: &str,
) {
    let x_max = xs
        .iter()
        .chain(points.iter().map(|(x, _, _)| x))
        .copied()
        .fold(0.0, f64::max)
        .max(1e-9);
    let px = |x: f64| x0 + x / x_max * PANEL_W;
    let py = |y: f64| y0 + PANEL_H - y.clamp(0.0, 1.0) * PANEL_H;
    let _ = writeln!(
        svg,
        r##"<rect x="{x0}" y="{y0}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#888"/>"##
    );
    for t in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let y = py(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{t}</text>"##,
            x0 + PANEL_W,
            x0 - 6.0,
            y + 4.0
        );
    }
    for t in ticks(x_max) {
        let x = px(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#888"/><text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"##,
            y0 + PANEL_H,
            y0 + PANEL_H + 4.0,
            y0 + PANEL_H + 17.0,
            fmt_tick(t)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{xlabel}</text>"#,
        x0 + PANEL_W / 2.0,
        y0 + PANEL_H + 34.0
    );
    let window = (xs.len() / 20).clamp(1, 25);
    for (_, color, ys) in series {
        let points = |ys: &[f64]| {
            xs.iter()
                .zip(ys)
                .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-opacity="0.25" stroke-width="1"/>"#,
            points(ys)
        );
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            points(&moving_average(ys, window))
        );
    }
    for (x, e, color) in points {
        let x = px(*x);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{color}" stroke-width="2"/><circle cx="{x:.1}" cy="{:.1}" r="4" fill="white" stroke="{color}" stroke-width="2"/>"##,
            py(e.lo),
            py(e.hi),
            py(e.mean)
        );
    }
}

/// The series' colours under the panels, and what the circles are when there are any.
fn legend(svg: &mut String, series: &[(&str, &str, Vec<f64>)], circles: bool) {
    for (i, (name, color, _)) in series.iter().enumerate() {
        let x = 250.0 + i as f64 * 250.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{x}" y1="368" x2="{}" y2="368" stroke="{color}" stroke-width="2"/><text x="{}" y="372" font-size="12">{name} (smoothed; raw faint)</text>"#,
            x + 18.0,
            x + 22.0
        );
    }
    if circles {
        let _ = writeln!(
            svg,
            r#"<text x="{:.0}" y="390" font-size="12" text-anchor="middle">circles: held-out reward and pass@1 at the sampling temperature, with 95% intervals</text>"#,
            WIDTH / 2.0
        );
    }
}

/// Reward and accuracy against wall-clock time (left) and against step (right), with the
/// held-out evaluations on both.
pub fn learning_curve_svg(rows: &[StepRow], held_out: &[Marker], title: &str) -> String {
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/><text x="{:.0}" y="24" font-size="15" text-anchor="middle">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    let series = [
        (
            "reward",
            REWARD_COLOR,
            rows.iter()
                .map(|r| r.record.reward_mean)
                .collect::<Vec<_>>(),
        ),
        (
            "accuracy",
            ACCURACY_COLOR,
            rows.iter().map(|r| r.record.accuracy).collect::<Vec<_>>(),
        ),
    ];
    let times: Vec<f64> = rows.iter().map(|r| r.run.time_s).collect();
    let steps: Vec<f64> = rows.iter().map(|r| r.record.step as f64).collect();
    // A held-out point sits where its step finished (before RL: at 0).
    let time_of = |step: u64| {
        rows.iter()
            .find(|r| r.record.step == step)
            .map_or(0.0, |r| r.run.time_s)
    };
    let marks = |x: &dyn Fn(&Marker) -> f64| -> Vec<(f64, Estimate, &str)> {
        held_out
            .iter()
            .flat_map(|m| {
                [
                    (x(m), m.reward, REWARD_COLOR),
                    (x(m), m.pass_at_1, ACCURACY_COLOR),
                ]
            })
            .collect()
    };
    let by_time = marks(&|m| time_of(m.step));
    let by_step = marks(&|m| m.step as f64);
    panel(
        &mut svg,
        60.0,
        50.0,
        &times,
        &series,
        &by_time,
        "wall-clock time (s)",
    );
    panel(
        &mut svg,
        530.0,
        50.0,
        &steps,
        &series,
        &by_step,
        "trainer step",
    );
    legend(&mut svg, &series, !held_out.is_empty());
    svg.push_str("</svg>\n");
    svg
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moving_average_and_ticks() {
        assert_eq!(moving_average(&[1.0, 3.0, 5.0], 2), vec![1.0, 2.0, 4.0]);
        assert_eq!(ticks(10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(0.0), vec![0.0]);
        assert_eq!(ticks(37.0), vec![0.0, 10.0, 20.0, 30.0]);
    }

    #[test]
    fn csv_has_a_header_and_one_line_per_row() {
        let rows = vec![
            StepRow {
                record: StepRecord {
                    step: 1,
                    reward_mean: 0.5,
                    skipped: true,
                    ..StepRecord::default()
                },
                run: RunProgress {
                    queue_scored: 4,
                    ..RunProgress::default()
                },
            },
            StepRow::default(),
        ];
        let columns = columns();
        let fields = serde_json::to_value(StepRow::default()).unwrap();
        let fields = fields.as_object().unwrap();
        assert_eq!(fields.len(), columns.len());
        assert!(columns.iter().all(|c| fields.contains_key(*c)));
        assert_eq!(columns[..3], ["step", "time_s", "version"]);
        let text = csv(&rows).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0].split(',').count(), columns.len());
        assert!(lines[1].starts_with("1,0.0,0,0.0,0.5,"), "{}", lines[1]);
        assert!(lines[1].ends_with(",0,0,4"), "{}", lines[1]);
        let skipped = columns.iter().position(|c| *c == "skipped").unwrap();
        assert_eq!(lines[1].split(',').nth(skipped), Some("1"));
        let teacher = columns.iter().position(|c| *c == "teacher_kl").unwrap();
        assert_eq!(
            lines[1].split(',').nth(teacher),
            Some(""),
            "not measured: empty"
        );
        for l in &lines[1..] {
            assert_eq!(l.split(',').count(), columns.len(), "{l}");
        }
    }

    #[test]
    fn estimates_carry_the_standard_error_of_the_mean() {
        let e = Estimate::of(&[0.0, 1.0, 0.0, 1.0]);
        assert_eq!(e.mean, 0.5);
        // Sample variance 1/3, over n = 4.
        assert!((e.se - (1.0f64 / 12.0).sqrt()).abs() < 1e-12, "{e:?}");
        assert!((e.hi - e.lo - 2.0 * Z95 * e.se).abs() < 1e-12);
        let d = e.minus(&Estimate::of(&[0.0, 0.0, 0.0, 1.0]));
        assert_eq!(d.mean, 0.25);
        assert!(d.se > e.se);
        assert_eq!(Estimate::of(&[]), Estimate::default());
        assert_eq!(Estimate::of(&[0.7]).se, 0.0);
        // A rate's interval stays within [0, 1] (the normal approximation reaches -0.24).
        let r = Estimate::rate(&[0.0, 0.0, 0.0, 1.0]);
        assert!(Estimate::of(&[0.0, 0.0, 0.0, 1.0]).lo < 0.0);
        assert_eq!((r.lo, r.mean), (0.0, 0.25));
        assert!(r.hi <= 1.0);
    }
}
