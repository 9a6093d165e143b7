//! Retention: removing old stream entries without losing unfinished work.
//!
//! Streams are unbounded by default. [`trim`] removes entries older than a cut, where the
//! cut is what the policy asks for ([`Keep`]) but never past an entry some consumer group
//! has not finished: the oldest entry pending in any group, or the first one not yet
//! delivered to it. With an archive path it writes the removed range there first.
//! `rlstream trim` runs it once; a `trim_keep_last` or `trim_older_than_s` in the topology
//! makes the stages run it as they go ([`spawn_standing`]).

use crate::archive::{self, ArchiveError};
pub use crate::bus::Keep;
use crate::bus::{Bus, EntryId, RangeBound, SharedBus, Topology};
use crate::roles::Stage;
use serde::Serialize;
use std::path::Path;
use std::time::Duration;

/// How often stages apply the standing policy.
pub const STANDING_EVERY: Duration = Duration::from_secs(60);

/// What a trim did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrimReport {
    pub stream: String,
    pub removed: u64,
    /// Entries below this id were removed.
    pub cut: Option<String>,
    /// The group whose unfinished work stopped the cut short of the policy, and its id.
    pub held_back_by: Option<(String, String)>,
    /// Entries written to the archive before removal.
    pub archived: u64,
}

impl TrimReport {
    /// The one-line human summary; `archive` is where the removed entries went, if anywhere.
    pub fn line(&self, archive: Option<&std::path::Path>) -> String {
        let mut line = format!("removed {} entries from {}", self.removed, self.stream);
        if let Some(cut) = &self.cut {
            line += &format!(" (below {cut})");
        }
        if let Some(a) = archive {
            line += &format!("; archived {} to {}", self.archived, a.display());
        }
        if let Some((group, id)) = &self.held_back_by {
            line += &format!("; stopped at {id}, which group `{group}` has not finished");
        }
        line
    }
}

/// The lowest id any group still needs: its oldest pending entry or its first undelivered
/// one, with the group's name. None when the stream has no groups.
pub async fn floor(bus: &dyn Bus, key: &str) -> Result<Option<(EntryId, String)>, ArchiveError> {
    let stats = bus.stats(key).await?;
    let mut low: Option<(EntryId, String)> = None;
    for g in &stats.groups {
        let mut need = g.last_delivered.next();
        if let Some(p) = bus.oldest_pending(key, &g.name).await? {
            need = need.min(p);
        }
        if low.as_ref().is_none_or(|(id, _)| need < *id) {
            low = Some((need, g.name.clone()));
        }
    }
    Ok(low)
}

/// The id of the first entry to keep under `keep`, or None when nothing is to go.
async fn target(bus: &dyn Bus, key: &str, keep: Keep) -> Result<Option<EntryId>, ArchiveError> {
    match keep {
        Keep::Newer(age) => {
            let now_ms = crate::schema::now_us() / 1000;
            Ok(Some(EntryId::new(
                now_ms.saturating_sub(age.as_millis() as u64),
                0,
            )))
        }
        Keep::Last(n) => {
            let len = bus.stats(key).await?.length;
            if len <= n {
                return Ok(None);
            }
            // Walk to the (len − n)-th entry: the first one kept.
            let mut skip = len - n;
            let mut first_kept = None;
            crate::bus::scan(
                bus,
                key,
                RangeBound::Open,
                RangeBound::Open,
                |page| match page.get(skip as usize) {
                    Some(e) => {
                        first_kept = Some(e.id);
                        false
                    }
                    None => {
                        skip -= page.len() as u64;
                        true
                    }
                },
            )
            .await?;
            Ok(first_kept)
        }
    }
}

/// Trims stream `name` of `topo` under `keep`, never past unfinished work; with `archive`,
/// writes what it removes there first (nothing is removed if that fails).
pub async fn trim(
    bus: &dyn Bus,
    topo: &Topology,
    name: &str,
    keep: Keep,
    archive: Option<&Path>,
) -> Result<TrimReport, ArchiveError> {
    let key = topo.key(name);
    let mut report = TrimReport {
        stream: key.clone(),
        removed: 0,
        cut: None,
        held_back_by: None,
        archived: 0,
    };
    let Some(mut cut) = target(bus, &key, keep).await? else {
        return Ok(report);
    };
    if let Some((need, group)) = floor(bus, &key).await?
        && need < cut
    {
        cut = need;
        report.held_back_by = Some((group, need.to_string()));
    }
    report.cut = Some(cut.to_string());
    if let Some(path) = archive {
        let moved = archive::dump(
            bus,
            topo,
            &[name.to_string()],
            RangeBound::Open,
            RangeBound::Exclusive(cut),
            path,
            |_, _| {},
        )
        .await?;
        report.archived = moved.entries;
    }
    report.removed = bus.trim_before(&key, cut).await?;
    Ok(report)
}

/// The standing-trim task of a stage; stops when dropped.
pub struct Standing(tokio::task::JoinHandle<()>);

impl Drop for Standing {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Applies the topology's standing trim policy to `streams` every [`STANDING_EVERY`] while
/// the returned handle lives (None when none of them has a policy). Failures are counted
/// (`errors_total{kind="trim"}`) and retried.
pub fn spawn_standing(
    bus: SharedBus,
    topo: &Topology,
    streams: &[&str],
    stage: Stage,
) -> Option<Standing> {
    let topo = topo.clone();
    let policies: Vec<(String, Keep)> = streams
        .iter()
        .filter_map(|s| {
            let keep = topo.streams.get(*s)?.trim_policy()?;
            Some((s.to_string(), keep))
        })
        .collect();
    if policies.is_empty() {
        return None;
    }
    crate::metrics::error_n(stage, "trim", 0);
    Some(Standing(tokio::spawn(async move {
        let mut tick = tokio::time::interval(STANDING_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for (name, keep) in &policies {
                match trim(bus.as_ref(), &topo, name, *keep, None).await {
                    Ok(r) if r.removed > 0 => {
                        tracing::info!(stream = %r.stream, removed = r.removed, cut = ?r.cut, "standing trim")
                    }
                    Ok(_) => {}
                    Err(e) => {
                        crate::metrics::error(stage, "trim");
                        tracing::warn!(stream = name, error = %e, "standing trim failed; retrying later");
                    }
                }
            }
        }
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::{GroupStart, MemoryBus, ReadFrom};
    use crate::roles::Stream;
    use bytes::Bytes;

    async fn stream_of(bus: &MemoryBus, key: &str, n: u64) -> Vec<EntryId> {
        let entries: Vec<(EntryId, Bytes)> = (1..=n)
            .map(|i| (EntryId::new(i, 0), Bytes::from(vec![i as u8])))
            .collect();
        bus.append(key, &entries).await.expect("append");
        entries.into_iter().map(|(id, _)| id).collect()
    }

    #[tokio::test]
    async fn keep_last_stops_at_unfinished_work() {
        let bus = MemoryBus::new();
        let topo = Topology::default();
        let key = topo.key(Stream::Scored);
        bus.create_group(&key, "train", GroupStart::Beginning)
            .await
            .expect("group");
        let ids = stream_of(&bus, &key, 10).await;
        // The trainer took 6 and acked the first 3: entries 4..6 are pending.
        bus.read_group(&key, "train", "t", ReadFrom::New, 6, None)
            .await
            .expect("read");
        bus.ack(&key, "train", &ids[..3]).await.expect("ack");
        let r = trim(&bus, &topo, "scored", Keep::Last(2), None)
            .await
            .expect("trim");
        assert_eq!(r.removed, 3, "{r:?}");
        assert_eq!(r.held_back_by, Some(("train".into(), ids[3].to_string())));
        // Everything acked and delivered: now keep-last applies in full.
        bus.ack(&key, "train", &ids[3..6]).await.expect("ack");
        bus.read_group(&key, "train", "t", ReadFrom::New, 10, None)
            .await
            .expect("read");
        bus.ack(&key, "train", &ids[6..]).await.expect("ack");
        let r = trim(&bus, &topo, "scored", Keep::Last(2), None)
            .await
            .expect("trim");
        assert_eq!((r.removed, r.held_back_by.as_ref()), (5, None));
        assert_eq!(bus.stats(&key).await.expect("stats").length, 2);
    }

    #[tokio::test]
    async fn stages_apply_the_standing_policy() {
        let text = crate::bus::topology::DEFAULT_TOPOLOGY.replacen(
            "max_len = 100000",
            "max_len = 100000\ntrim_keep_last = 3",
            1,
        );
        let topo = Topology::parse(&text, "test").expect("topology");
        let bus = MemoryBus::shared();
        let key = topo.key(Stream::Events);
        stream_of(&bus, &key, 10).await;
        let shared: SharedBus = bus.clone();
        // No policy on the stream asked for: no task.
        assert!(spawn_standing(shared.clone(), &topo, &["prompts"], Stage::Train).is_none());
        let task =
            spawn_standing(shared, &topo, &["events", "prompts"], Stage::Train).expect("task");
        // The first round runs at once.
        for _ in 0..100 {
            if bus.stats(&key).await.expect("stats").length == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(bus.stats(&key).await.expect("stats").length, 3);
        drop(task);
    }

    #[tokio::test]
    async fn undelivered_entries_are_never_trimmed_and_archive_first() {
        let bus = MemoryBus::new();
        let topo = Topology::default();
        let key = topo.key(Stream::Prompts);
        bus.create_group(&key, "gen", GroupStart::Beginning)
            .await
            .expect("group");
        stream_of(&bus, &key, 5).await;
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("old.rla");
        // Entry ids are from 1970: all older than a day, but none delivered yet.
        let r = trim(
            &bus,
            &topo,
            "prompts",
            Keep::Newer(Duration::from_secs(86_400)),
            Some(&path),
        )
        .await
        .expect("trim");
        assert_eq!((r.removed, r.archived), (0, 0));
        bus.read_group(&key, "gen", "g", ReadFrom::New, 2, None)
            .await
            .expect("read");
        let ids: Vec<EntryId> = (1..=2).map(|i| EntryId::new(i, 0)).collect();
        bus.ack(&key, "gen", &ids).await.expect("ack");
        let r = trim(
            &bus,
            &topo,
            "prompts",
            Keep::Newer(Duration::from_secs(86_400)),
            Some(&path),
        )
        .await
        .expect("trim");
        assert_eq!((r.removed, r.archived), (2, 2));
        let archived: Vec<EntryId> = archive::Reader::open(&path)
            .expect("archive")
            .map(|e| e.expect("entry").id)
            .collect();
        assert_eq!(archived, ids);
    }
}
