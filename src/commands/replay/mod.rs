//! `rlstream replay`: read any range of any stream, from Redis or from an archive, filter
//! it, and print it as JSON lines, a table or detokenised text; and `replay --train`:
//! re-run the trainer from a checkpoint over recorded scored entries and compare every step
//! with the recorded run, bit for bit.

mod filter;
mod message;
mod read;
mod render;
mod retrain;
mod source;

pub use filter::RewardFilter;
pub use read::{Format, ReadOptions, read};
pub use retrain::{RetrainOptions, RetrainStep, RetrainSummary, retrain, retrain_header};
pub use source::{ReplayError, Source};

use crate::bus::EntryId;

/// `--from`/`--to`: an entry id (`MS-SEQ`), milliseconds since the epoch (`MS`), a UTC time
/// (`2026-11-29T16:30:00Z`, seconds optional), or a time ago (`-90s`, `-10m`, `-2h`,
/// `-1d`). Times become the first id at that millisecond.
pub fn parse_point(s: &str) -> Result<EntryId, ReplayError> {
    let bad = || {
        ReplayError::Usage(format!(
            "`{s}` is not an entry id (MS-SEQ), epoch milliseconds, a UTC time (2026-11-29T16:30:00Z) or a time ago (-10m)"
        ))
    };
    if let Ok(id) = s.parse::<EntryId>() {
        return Ok(id);
    }
    if let Ok(ms) = s.parse::<u64>() {
        return Ok(EntryId::new(ms, 0));
    }
    if let Some(ago) = s.strip_prefix('-') {
        let ago = crate::time::parse_duration(ago).ok_or_else(bad)?;
        let now_ms = crate::time::now_ms();
        return Ok(EntryId::new(
            now_ms.saturating_sub(ago.as_millis() as u64),
            0,
        ));
    }
    crate::time::parse_utc_ms(s)
        .map(|ms| EntryId::new(ms, 0))
        .ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema;

    #[test]
    fn points_parse_as_ids_times_and_ages() {
        let p = |s: &str| parse_point(s).map_err(|e| e.to_string());
        assert_eq!(p("1764433812345-7"), Ok(EntryId::new(1_764_433_812_345, 7)));
        assert_eq!(p("1764433812345"), Ok(EntryId::new(1_764_433_812_345, 0)));
        assert_eq!(p("1970-01-01T00:00:00Z"), Ok(EntryId::new(0, 0)));
        assert_eq!(
            p("2024-02-29T12:34:56Z"),
            Ok(EntryId::new(1_709_210_096_000, 0))
        );
        assert_eq!(
            p("2024-02-29T12:34Z"),
            Ok(EntryId::new(1_709_210_040_000, 0))
        );
        let now = schema::now_us() / 1000;
        let ago = parse_point("-10m").expect("ago").ms;
        assert!(
            (now - 600_000..=now - 599_000).contains(&ago),
            "{ago} vs {now}"
        );
        for bad in [
            "yesterday",
            "-10x",
            "2024-13-01T00:00:00Z",
            "2024-02-29 12:34:56",
            "--5m",
        ] {
            let e = p(bad).expect_err(bad);
            assert!(e.contains("is not an entry id"), "{e}");
        }
    }
}
