//! Time as the rest of rlstream needs it, in one place: now since the epoch, UTC dates
//! read and written through the `time` crate, and durations as people write them (`90s`,
//! `30m`, `12h`, `7d`).

use std::time::Duration;
use time::format_description::well_known::Rfc3339;
use time::macros::format_description;
use time::{OffsetDateTime, PrimitiveDateTime};

/// Microseconds since the Unix epoch (0 on a clock set before 1970).
pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    now_us() / 1000
}

/// `YYYY-MM-DD HH:MM:SS UTC` of a time in microseconds since the epoch.
pub fn utc(time_us: u64) -> String {
    let format = format_description!("[year]-[month]-[day] [hour]:[minute]:[second] UTC");
    i128::from(time_us)
        .checked_mul(1000)
        .and_then(|ns| OffsetDateTime::from_unix_timestamp_nanos(ns).ok())
        .and_then(|t| t.format(&format).ok())
        .unwrap_or_else(|| format!("{time_us} us after the epoch"))
}

/// Milliseconds since the epoch of a UTC time written `2026-11-29T16:30:00Z` (RFC 3339,
/// fractions and offsets allowed) or without seconds, `2026-11-29T16:30Z`.
pub fn parse_utc_ms(s: &str) -> Option<u64> {
    let t = OffsetDateTime::parse(s, &Rfc3339).ok().or_else(|| {
        let minutes = format_description!("[year]-[month]-[day]T[hour]:[minute]Z");
        PrimitiveDateTime::parse(s, &minutes)
            .ok()
            .map(PrimitiveDateTime::assume_utc)
    })?;
    u64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates_both_ways() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        // A leap day.
        assert_eq!(utc(1_709_210_096_000_000), "2024-02-29 12:34:56 UTC");
        assert_eq!(
            parse_utc_ms("2024-02-29T12:34:56Z"),
            Some(1_709_210_096_000)
        );
        assert_eq!(parse_utc_ms("2024-02-29T12:34Z"), Some(1_709_210_040_000));
        assert_eq!(
            parse_utc_ms("2024-02-29T12:34:56.5Z"),
            Some(1_709_210_096_500)
        );
        assert_eq!(
            parse_utc_ms("2023-02-29T12:34:56Z"),
            None,
            "not a leap year"
        );
        assert_eq!(
            parse_utc_ms("1969-12-31T23:59:59Z"),
            None,
            "before the epoch"
        );
        assert_eq!(parse_utc_ms("yesterday"), None);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5h"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("7d"), Some(Duration::from_secs(604_800)));
        assert_eq!(parse_duration("-1m"), None);
        assert_eq!(parse_duration("5w"), None);
    }
}
