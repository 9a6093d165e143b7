//! `rlstream feed`: pushes prompts from a built-in task or a dataset (JSONL, Parquet) to the prompts
//! stream, in pipelined batches.

mod config;
pub mod difficulty;
pub use config::*;

use super::{StageContext, StageError};
use crate::bus::{SharedBus, Topology};
use crate::roles::Stream;
use crate::schema::{self, Prompt, SchemaVersion};
use crate::tasks::{self, Dataset, TaskItem};
use bytes::Bytes;
pub use difficulty::{DifficultyPool, DifficultyState};
use rand::SeedableRng;
use rand::seq::SliceRandom;

/// Prompts per pipelined publish.
const FEED_BATCH: usize = 256;
/// How often a paced feed looks at the prompts waiting.
const PACE_POLL: std::time::Duration = std::time::Duration::from_millis(200);
/// Most prompt entries read to count what waits (see [`super::waiting`]).
const WAITING_SCAN_CAP: u64 = 10_000;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FeedSummary {
    pub fed: u64,
    /// A dataset's bad rows, skipped (each pass).
    pub skipped: u64,
    /// Of `fed`, prompts fed again by the difficulty-aware feed.
    pub reoffered: u64,
}

/// What a feed config describes: the task name, the prompts with their ids, and how many of
/// a dataset's rows were bad and skipped.
pub struct Feed {
    pub task: String,
    pub items: Vec<(String, TaskItem)>,
    pub skipped: u64,
}

/// The prompts a feed config describes, with their ids.
/// A dataset's bad rows are skipped and reported (a warning), never fed.
pub fn items(cfg: &FeedConfig) -> Result<Feed, StageError> {
    match (&cfg.task, &cfg.dataset) {
        (Some(_), Some(_)) => Err(StageError::Other(
            "give --task or --dataset, not both".into(),
        )),
        (None, None) => Err(StageError::Other(
            "give --task add|reverse|sort|longsort|longer or --dataset FILE (.jsonl or .parquet)"
                .into(),
        )),
        (Some(task), None) => Ok(Feed {
            task: task.name().to_string(),
            items: (0..cfg.count)
                .map(|i| (task.prompt_id(i), task.item(cfg.seed, i)))
                .collect(),
            skipped: 0,
        }),
        (None, Some(path)) => {
            let mut d = Dataset::load_reported(path, &cfg.columns())?;
            if d.has_chat() {
                render_chat(&mut d, path, cfg.chat_template.as_deref())?;
            }
            let mut out = Vec::new();
            let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
            for epoch in 0..cfg.epochs.max(1) {
                let mut order: Vec<usize> = (0..d.items.len()).collect();
                if cfg.shuffle {
                    order.shuffle(&mut rng);
                }
                for i in order {
                    let it = &d.items[i];
                    out.push((d.item_id(epoch, it), it.item.clone()));
                }
            }
            Ok(Feed {
                skipped: d.skipped.len() as u64,
                task: d.name,
                items: out,
            })
        }
    }
}

/// Renders a dataset's chat rows with the chat template of `model`.
pub fn render_chat(
    d: &mut Dataset,
    path: &std::path::Path,
    model: Option<&std::path::Path>,
) -> Result<(), StageError> {
    let Some(dir) = model else {
        return Err(StageError::Other(format!(
            "{} has `messages` rows: give --chat-template DIR (the policy model's directory) \
             to render them with its chat template",
            path.display()
        )));
    };
    let template = crate::model::chat::ChatTemplate::load(dir)?.ok_or_else(|| {
        StageError::Other(format!(
            "{} has no chat template (tokenizer_config.json with chat_template) to render the \
             `messages` rows of {}",
            dir.display(),
            path.display()
        ))
    })?;
    d.render(&template)
        .map_err(|e| StageError::Other(format!("{}: {e}", path.display())))
}

/// Publishes `items` of `task` to the prompts stream in one pipelined batch. Built-in task
/// prompts carry their tokens (the character tokenizer); dataset prompts are tokenised by
/// the generator with its model's tokenizer.
pub async fn publish(
    bus: &SharedBus,
    topo: &Topology,
    task: &str,
    items: &[(String, TaskItem)],
    builtin: bool,
) -> Result<u64, StageError> {
    let tok = tasks::char_tokenizer();
    let payloads = items
        .iter()
        .map(|(id, item)| {
            let p = Prompt {
                schema: SchemaVersion::CURRENT,
                prompt_id: id.clone(),
                task: task.to_string(),
                text: item.prompt.clone(),
                prompt_tokens: builtin.then(|| tok.encode(&item.prompt).into()),
                meta: item.meta.clone(),
                created_us: schema::now_us(),
            };
            schema::encode(&p).map(Bytes::from)
        })
        .collect::<Result<Vec<_>, _>>()?;
    bus.publish(
        &topo.key(Stream::Prompts),
        &payloads,
        topo.max_len(Stream::Prompts),
    )
    .await?;
    crate::metrics::fed(payloads.len() as u64);
    Ok(payloads.len() as u64)
}

/// Feeds the prompts `cfg` names until they are all on the prompts stream or shutdown;
/// with `difficulty.reoffer`, paced, re-offering scored prompts (see [`difficulty`]).
pub async fn run(
    cfg: &FeedConfig,
    difficulty: &DifficultyConfig,
    mut ctx: StageContext<'_>,
) -> Result<FeedSummary, StageError> {
    let feed = items(cfg)?;
    if difficulty.reoffer > 0.0 {
        return paced(cfg, difficulty, ctx, feed).await;
    }
    let Feed {
        task,
        items,
        skipped,
    } = feed;
    let (bus, topo) = (ctx.bus.clone(), ctx.topo);
    let mut fed = 0u64;
    for chunk in items.chunks(FEED_BATCH) {
        tokio::select! {
            biased;
            _ = ctx.shutdown() => break,
            r = publish(&bus, topo, &task, chunk, cfg.task.is_some()) => fed += r?,
        }
    }
    tracing::info!(fed, stream = %topo.key(Stream::Prompts), "fed prompts");
    Ok(FeedSummary {
        fed,
        skipped,
        reoffered: 0,
    })
}

/// How often a paced feed checks that its saved state is still on the bus.
const STATE_CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// A paced feed's check for a Redis that came back without its data: the state it saved
/// is gone. The feed keeps its schedule in memory and saves it again with its next
/// publish; the backlog it tops up replaces the prompts that waited on the stream.
#[derive(Default)]
struct LossCheck {
    saved: bool,
    last: Option<std::time::Instant>,
}

impl LossCheck {
    fn saved(&mut self) {
        self.saved = true;
    }

    async fn check(
        &mut self,
        bus: &dyn crate::bus::Bus,
        key: &str,
        backlog: u64,
    ) -> Result<(), StageError> {
        if !self.saved || self.last.is_some_and(|t| t.elapsed() < STATE_CHECK_EVERY) {
            return Ok(());
        }
        self.last = Some(std::time::Instant::now());
        let kept = bus.get_blobs(&[key.to_string()]).await?;
        if kept.first().is_some_and(Option::is_none) {
            self.saved = false;
            crate::metrics::data_loss(key, "feed");
            tracing::warn!(
                "Redis lost its data: the feed's saved schedule ({key}) is gone, and with it \
                 up to {backlog} prompts that waited on the prompts stream. The feed goes on \
                 from its schedule, tops the backlog up again and saves the schedule with its \
                 next publish"
            );
        }
        Ok(())
    }
}

/// The bus key of a paced feed's state.
pub fn state_key(topo: &Topology) -> String {
    topo.key("feed:difficulty")
}

/// A paced feed: tops the prompts waiting up to `backlog`, each prompt new or (by the
/// pool's draw) one scored before, until the new ones run out; its pool's state is kept on
/// the bus after every publish, so a restarted feed continues the schedule (a crash between
/// a publish and its save feeds that batch again: at least once).
async fn paced(
    cfg: &FeedConfig,
    difficulty: &DifficultyConfig,
    mut ctx: StageContext<'_>,
    feed: Feed,
) -> Result<FeedSummary, StageError> {
    let (bus, topo) = (ctx.bus.clone(), ctx.topo);
    let key = state_key(topo);
    let state = match bus
        .get_blobs(std::slice::from_ref(&key))
        .await?
        .pop()
        .flatten()
    {
        Some(b) => rmp_serde::from_slice(&b).map_err(|e| {
            StageError::Other(format!(
                "the feed's saved state ({key}) does not read ({e}); delete the key to start \
                 the schedule afresh"
            ))
        })?,
        None => difficulty::DifficultyState::default(),
    };
    let mut pool = difficulty::DifficultyPool::resume(difficulty, cfg.seed, state);
    let mut items = feed.items.into_iter().skip(pool.state().fresh as usize);
    let mut fresh = || items.next();
    let (fresh_before, again_before) = (pool.state().fresh, pool.state().reoffered);
    let builtin = cfg.task.is_some();
    let mut saved = LossCheck::default();
    loop {
        saved.check(bus.as_ref(), &key, cfg.backlog).await?;
        pool.read_outcomes(bus.as_ref(), topo).await?;
        let waiting =
            super::waiting(bus.as_ref(), topo, Stream::Prompts, true, WAITING_SCAN_CAP).await;
        let want = cfg.backlog.saturating_sub(waiting) as usize;
        let batch: Vec<_> = (0..want.min(FEED_BATCH))
            .map_while(|_| pool.next(&mut fresh))
            .collect();
        if want > 0 && batch.is_empty() {
            break;
        }
        if !batch.is_empty() {
            publish(&bus, topo, &feed.task, &batch, builtin).await?;
            let state = rmp_serde::to_vec(pool.state())
                .map_err(|e| StageError::Other(format!("the feed's state: {e}")))?;
            bus.put_blobs(&[(key.clone(), Bytes::from(state))]).await?;
            saved.saved();
        }
        tokio::select! {
            biased;
            _ = ctx.shutdown() => break,
            () = tokio::time::sleep(PACE_POLL) => {}
        }
    }
    let s = pool.state();
    let reoffered = s.reoffered - again_before;
    let fed = s.fresh - fresh_before + reoffered;
    tracing::info!(fed, reoffered, outcomes = s.outcomes, "fed prompts (paced)");
    Ok(FeedSummary {
        fed,
        skipped: feed.skipped,
        reoffered,
    })
}
