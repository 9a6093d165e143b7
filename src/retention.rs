//! Retention: removing old stream entries without losing unfinished work.
//!
//! [`trim`] removes entries older than a cut, where the cut is what the policy asks for
//! ([`Keep`]: the newest N, the last so many seconds, or what fits in so many bytes of the
//! bus's memory) but never past an entry some consumer group has not finished: the oldest
//! entry pending in any group, or the first one not yet delivered to it. With an archive
//! path it writes the removed range there first. `rlstream trim` runs it once; the
//! topology's `trim_*` settings make the stages run it as they go ([`spawn_standing`]),
//! and the shipped topology gives every stream a memory limit, so Redis stays within a
//! budget by default. With the topology's `archive_dir`, standing trims archive what they
//! remove into one file per trim ([`archive_file`]).

use crate::archive::{self, ArchiveError};
pub use crate::bus::Keep;
use crate::bus::{Bus, EntryId, RangeBound, SharedBus, StreamStats, Topology};
use crate::roles::Stage;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A memory-bound trim keeps this share of the limit, so the stream does not sit at its
/// limit and trim on every round.
const BYTES_HEADROOM: f64 = 0.9;
/// Further trims a memory limit may take in one round (see [`trim_standing`]).
const BYTES_ROUNDS: usize = 3;
/// The share of its limit a stream may grow by between two rounds before they come sooner.
const PACE: f64 = 0.25;
/// How long a stopping stage waits for its last round.
const FINISH_WITHIN: Duration = Duration::from_secs(10);
/// The shortest wait between two rounds.
const MIN_ROUND_EVERY: Duration = Duration::from_millis(250);

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

/// The lowest id any group of the stream (`stats` of `key`) still needs: its oldest pending
/// entry or its first undelivered one, with the group's name. None when the stream has no
/// groups.
pub async fn floor(
    bus: &dyn Bus,
    key: &str,
    stats: &StreamStats,
) -> Result<Option<(EntryId, String)>, ArchiveError> {
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
        Keep::Bytes(max) => {
            let used = bus.memory_usage(key).await?;
            if used <= max {
                return Ok(None);
            }
            // Entries are about the same size within a stream: keep the newest share of
            // them that fits under the limit with some headroom.
            let len = bus.stats(key).await?.length;
            let keep = (len as f64 * BYTES_HEADROOM * max as f64 / used as f64).floor() as u64;
            first_of_last(bus, key, len, keep).await
        }
        Keep::Last(n) => {
            let len = bus.stats(key).await?.length;
            first_of_last(bus, key, len, n).await
        }
    }
}

/// The id of the first of the newest `n` of the stream's `len` entries (None when all of
/// them are kept). Reads the `len − n` entries before it, the ones a trim removes.
async fn first_of_last(
    bus: &dyn Bus,
    key: &str,
    len: u64,
    n: u64,
) -> Result<Option<EntryId>, ArchiveError> {
    if len <= n {
        return Ok(None);
    }
    if n == 0 {
        return Ok(bus.stats(key).await?.last_id.map(|id| id.next()));
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
    let stats = bus.stats(&key).await?;
    if let Some((need, group)) = floor(bus, &key, &stats).await?
        && need < cut
    {
        cut = need;
        report.held_back_by = Some((group, need.to_string()));
    }
    report.cut = Some(cut.to_string());
    if stats.first_id.is_none_or(|f| f >= cut) {
        // Nothing below the cut: no archive file for an empty range.
        return Ok(report);
    }
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
pub struct Standing {
    task: tokio::task::JoinHandle<()>,
    rounds: std::sync::Arc<Rounds>,
}

impl Standing {
    /// Stops the periodic task and runs one last round, so a stage that stops leaves its
    /// streams within their limits. Gives up after [`FINISH_WITHIN`] (a bus that is down
    /// must not hold a stopping stage).
    pub async fn finish(self) {
        self.task.abort();
        if tokio::time::timeout(FINISH_WITHIN, self.rounds.run())
            .await
            .is_err()
        {
            tracing::warn!(
                "the last standing trim did not finish in time; the next stage to run one will"
            );
        }
    }
}

impl Drop for Standing {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What one round of standing trims applies.
struct Rounds {
    bus: SharedBus,
    topo: Topology,
    policies: Vec<(String, Keep)>,
    stage: Stage,
    /// Each stream's memory when the last round left it.
    left: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

impl Rounds {
    /// Applies every policy once; failures are counted and logged, never returned. Returns
    /// the pace: the most a stream with a memory limit grew by since the last round, as a
    /// share of its limit.
    async fn run(&self) -> f64 {
        let (bus, topo) = (self.bus.as_ref(), &self.topo);
        let mut pace = 0f64;
        for (name, keep) in &self.policies {
            let key = topo.key(name);
            let keep = match *keep {
                Keep::Bytes(max) => {
                    let (limit, grew) = self.headroom(name, max, &key).await;
                    pace = pace.max(grew as f64 / max as f64);
                    Keep::Bytes(limit)
                }
                other => other,
            };
            match trim_standing(bus, topo, name, keep, topo.archive_dir.as_deref()).await {
                Ok(r) if r.removed > 0 => {
                    crate::metrics::trimmed(&r.stream, r.removed);
                    tracing::info!(stream = %r.stream, removed = r.removed, cut = ?r.cut, archived = r.archived, "standing trim")
                }
                Ok(r) => {
                    if let Some((group, id)) = &r.held_back_by {
                        tracing::debug!(stream = %r.stream, group, id, "standing trim held back by unfinished work");
                    }
                }
                Err(e) => {
                    crate::metrics::error(self.stage, "trim");
                    tracing::warn!(stream = name, error = %e, "standing trim failed; retrying later");
                }
            }
            if let Ok(bytes) = bus.memory_usage(&key).await {
                crate::metrics::stream_bytes(&key, bytes);
                if let Ok(mut left) = self.left.lock() {
                    left.insert(name.clone(), bytes);
                }
            }
        }
        pace
    }

    /// The limit to trim `name` to this round so that it stays under `max` until the next,
    /// and what it grew by since the last round left it: `max` less that growth (at least
    /// half of `max`, so a burst cannot empty it).
    async fn headroom(&self, name: &str, max: u64, key: &str) -> (u64, u64) {
        let left = self.left.lock().ok().and_then(|l| l.get(name).copied());
        let (Some(left), Ok(now)) = (left, self.bus.memory_usage(key).await) else {
            return (max, 0);
        };
        let grew = now.saturating_sub(left);
        (max.saturating_sub(grew).max(max / 2), grew)
    }
}

/// The wait before the next round: a stream that grew by more than [`PACE`] of its limit
/// in the last wait is trimmed that much sooner (down to [`MIN_ROUND_EVERY`]), and the
/// wait returns to `every` as it calms down.
fn next_wait(last: Duration, pace: f64, every: Duration) -> Duration {
    let scaled = if pace > 0.0 {
        last.mul_f64((PACE / pace).min(2.0))
    } else {
        every
    };
    scaled.clamp(MIN_ROUND_EVERY.min(every), every)
}

/// A new archive file for a standing trim of `stream` into `dir` whose range starts at
/// `first`: `{namespace}.{stream}.{first}.{pid}-{time}.rla`. The name is unique per trim,
/// so two processes trimming one stream never overwrite each other's files (readers drop
/// an entry that two files hold).
pub fn archive_file(dir: &Path, topo: &Topology, stream: &str, first: EntryId) -> PathBuf {
    dir.join(format!(
        "{}.{stream}.{first}.{}-{}.rla",
        topo.namespace,
        std::process::id(),
        crate::schema::now_us()
    ))
}

/// The archive files standing trims wrote for `stream` into `dir` (see [`archive_file`]),
/// each with its first entry's id, in that order; empty files are left out. A missing
/// directory holds none.
pub fn archive_files(
    dir: &Path,
    topo: &Topology,
    stream: &str,
) -> Result<Vec<(EntryId, PathBuf)>, ArchiveError> {
    let prefix = format!("{}.{stream}.", topo.namespace);
    let mut found = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(ArchiveError::io(dir, e)),
    };
    for entry in entries {
        let path = entry.map_err(|e| ArchiveError::io(dir, e))?.path();
        let ours = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".rla"));
        if !ours {
            continue;
        }
        // The name's id is where the trim meant to start; the file's first entry is
        // where it did (another process may have trimmed first).
        if let Some(first) = archive::Reader::open(&path)?.next().transpose()? {
            found.push((first.id, path));
        }
    }
    found.sort();
    Ok(found)
}

/// Applies `keep` to `name`, archiving into `dir` when given (a new file per trim; none
/// when the trim removed nothing). A memory limit is applied again while the stream is
/// still over it and more can go: Redis frees a stream node only once all its entries are
/// gone, so memory falls less than in proportion to the entries removed.
async fn trim_standing(
    bus: &dyn Bus,
    topo: &Topology,
    name: &str,
    keep: Keep,
    dir: Option<&Path>,
) -> Result<TrimReport, ArchiveError> {
    let mut total = trim_once(bus, topo, name, keep, dir).await?;
    if let Keep::Bytes(max) = keep {
        for _ in 0..BYTES_ROUNDS {
            if total.removed == 0
                || total.held_back_by.is_some()
                || bus.memory_usage(&topo.key(name)).await? <= max
            {
                break;
            }
            let r = trim_once(bus, topo, name, keep, dir).await?;
            if r.removed == 0 {
                break;
            }
            total.removed += r.removed;
            total.archived += r.archived;
            total.cut = r.cut;
            total.held_back_by = r.held_back_by;
        }
    }
    Ok(total)
}

/// One [`trim`] of `name`, into a new archive file in `dir` when given.
async fn trim_once(
    bus: &dyn Bus,
    topo: &Topology,
    name: &str,
    keep: Keep,
    dir: Option<&Path>,
) -> Result<TrimReport, ArchiveError> {
    let (Some(dir), Some(first)) = (dir, bus.stats(&topo.key(name)).await?.first_id) else {
        return trim(bus, topo, name, keep, None).await;
    };
    std::fs::create_dir_all(dir).map_err(|e| ArchiveError::io(dir, e))?;
    let path = archive_file(dir, topo, name, first);
    let report = trim(bus, topo, name, keep, Some(&path)).await?;
    if report.archived == 0 && path.exists() {
        std::fs::remove_file(&path).map_err(|e| ArchiveError::io(&path, e))?;
    }
    Ok(report)
}

/// Applies the topology's standing trim policies to `streams` every `trim_every_ms`
/// while the returned handle lives (None when none of them has a policy), archiving into
/// the topology's `archive_dir` when it has one. Failures are counted
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
        .flat_map(|s| {
            let keeps = topo
                .streams
                .get(*s)
                .map(|spec| spec.trim_policies())
                .unwrap_or_default();
            keeps.into_iter().map(move |k| (s.to_string(), k))
        })
        .collect();
    if policies.is_empty() {
        return None;
    }
    crate::metrics::error_n(stage, "trim", 0);
    let every = Duration::from_millis(topo.trim_every_ms);
    let rounds = std::sync::Arc::new(Rounds {
        bus,
        topo,
        policies,
        stage,
        left: Default::default(),
    });
    let task = {
        let rounds = rounds.clone();
        tokio::spawn(async move {
            let mut wait = every;
            loop {
                let pace = rounds.run().await;
                wait = next_wait(wait, pace, every);
                tokio::time::sleep(wait).await;
            }
        })
    };
    Some(Standing { task, rounds })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::{GroupStart, MemoryBus, ReadFrom};
    use crate::roles::Stream;
    use bytes::Bytes;
    use std::sync::Arc;

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

    /// The shipped topology's `rollouts` stream on a new embedded bus, with its `score`
    /// group.
    async fn rollouts_for_score() -> (Topology, String, Arc<MemoryBus>) {
        let topo = Topology::default();
        let key = topo.key(Stream::Rollouts);
        let bus = MemoryBus::shared();
        bus.create_group(&key, "score", GroupStart::Beginning)
            .await
            .expect("group");
        (topo, key, bus)
    }

    /// Entries `from..from + n` (ids `i-0`) of 1,000 bytes each.
    fn kilobytes(from: u64, n: u64) -> Vec<(EntryId, Bytes)> {
        (from..from + n)
            .map(|i| (EntryId::new(i, 0), Bytes::from(vec![i as u8; 1000])))
            .collect()
    }

    /// The shipped topology without its memory limits.
    fn unbounded() -> String {
        crate::bus::topology::DEFAULT_TOPOLOGY
            .lines()
            .filter(|l| !l.starts_with("trim_max_bytes"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[tokio::test]
    async fn stages_apply_the_standing_policy() {
        let text = unbounded().replacen(
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

    /// A memory limit trims the oldest finished entries until the stream fits, archives
    /// them into the archive directory (one file per trim, none when nothing went), and
    /// stops at unfinished work.
    #[tokio::test]
    async fn a_memory_limit_trims_finished_entries_into_the_archive_dir() {
        let (topo, key, shared) = rollouts_for_score().await;
        let bus = shared.as_ref();
        let entries = kilobytes(1, 100);
        bus.append(&key, &entries).await.expect("append");
        let each = 1000 + MemoryBus::ENTRY_OVERHEAD;
        let limit = Keep::Bytes(50 * each);
        let dir = tempfile::tempdir().expect("tmp");
        // Nothing delivered yet: nothing may go, and no file is left behind.
        let r = trim_standing(bus, &topo, "rollouts", limit, Some(dir.path()))
            .await
            .expect("trim");
        assert_eq!(r.removed, 0);
        assert!(
            archive_files(dir.path(), &topo, "rollouts")
                .expect("list")
                .is_empty()
        );
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
        // The scorer finished the first 80: the limit keeps 90% of 50 entries.
        bus.read_group(&key, "score", "s", ReadFrom::New, 80, None)
            .await
            .expect("read");
        let ids: Vec<EntryId> = entries.iter().map(|(id, _)| *id).collect();
        bus.ack(&key, "score", &ids[..80]).await.expect("ack");
        let r = trim_standing(bus, &topo, "rollouts", limit, Some(dir.path()))
            .await
            .expect("trim");
        assert_eq!((r.removed, r.archived), (55, 55), "{r:?}");
        assert!(bus.memory_usage(&key).await.expect("memory") <= 50 * each);
        // Under the limit now: nothing more goes, whatever is finished.
        let r = trim_standing(bus, &topo, "rollouts", limit, Some(dir.path()))
            .await
            .expect("trim");
        assert_eq!(r.removed, 0);
        // A tighter limit stops past the last finished entry, 80.
        let r = trim_standing(bus, &topo, "rollouts", Keep::Bytes(each), Some(dir.path()))
            .await
            .expect("trim");
        assert_eq!(r.removed, 25, "{r:?}");
        assert_eq!(
            r.held_back_by,
            Some(("score".into(), ids[79].next().to_string()))
        );
        // Two files, oldest range first, holding entries 1..=80 in order.
        let files = archive_files(dir.path(), &topo, "rollouts").expect("list");
        assert_eq!(files.len(), 2);
        let archived: Vec<EntryId> = files
            .iter()
            .flat_map(|(_, p)| archive::Reader::open(p).expect("archive"))
            .map(|e| e.expect("entry").id)
            .collect();
        assert_eq!(archived, ids[..80]);
    }

    #[test]
    fn rounds_come_sooner_while_a_stream_grows_fast() {
        let every = Duration::from_secs(10);
        // Grew by its whole limit in 10 s: the next round in 2.5 s.
        assert_eq!(next_wait(every, 1.0, every), Duration::from_millis(2500));
        // Never below the floor, never above `every`, back up by at most 2× a round.
        assert_eq!(next_wait(every, 100.0, every), MIN_ROUND_EVERY);
        assert_eq!(
            next_wait(Duration::from_secs(1), 0.01, every),
            Duration::from_secs(2)
        );
        assert_eq!(next_wait(every, 0.0, every), every);
    }

    /// A stream that grew by G since the last round is trimmed to its limit less G (at
    /// least half the limit), so it is still under the limit when the next round comes.
    #[tokio::test]
    async fn a_round_leaves_room_for_what_the_stream_grows_by() {
        let (topo, key, bus) = rollouts_for_score().await;
        let each = 1000 + MemoryBus::ENTRY_OVERHEAD;
        let rounds = Rounds {
            bus: bus.clone(),
            topo: topo.clone(),
            policies: vec![("rollouts".into(), Keep::Bytes(50 * each))],
            stage: Stage::Score,
            left: Default::default(),
        };
        let add = |from: u64, n: u64| {
            let bus = bus.clone();
            let key = key.clone();
            async move {
                let entries = kilobytes(from, n);
                bus.append(&key, &entries).await.expect("append");
                bus.read_group(&key, "score", "s", ReadFrom::New, n as usize, None)
                    .await
                    .expect("read");
                let ids: Vec<EntryId> = entries.iter().map(|(id, _)| *id).collect();
                bus.ack(&key, "score", &ids).await.expect("ack");
            }
        };
        add(1, 40).await;
        rounds.run().await;
        assert_eq!(bus.stats(&key).await.expect("stats").length, 40);
        // 30 more since: trimmed to 90% of the limit less 30 entries, no less than half.
        add(41, 30).await;
        rounds.run().await;
        assert_eq!(bus.stats(&key).await.expect("stats").length, 22);
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
