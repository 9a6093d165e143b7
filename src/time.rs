//! Durations as people write them (`90s`, `30m`, `12h`, `7d`).

use std::time::Duration;

/// `90s`, `30m`, `12h`, `7d`: a number (fractions allowed) and a unit.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let (num, unit) = s.split_at(s.len().saturating_sub(1));
    let n: f64 = num.parse().ok()?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86_400.0,
        _ => return None,
    };
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs))
}
