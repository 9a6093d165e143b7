//! `replay`'s reading: the entries of one stream between two points, filtered by group,
//! staleness and reward, printed in the chosen format.

use super::filter::RewardFilter;
use super::message::{EntryMessage, decode, group_of, mean, rollout_of};
use super::render::{json_line, table_line, text_block};
use super::source::{ReplayError, Source};
use crate::bus::{EntryId, RangeBound};
use crate::model::tokenizer::Tokenizer;
use crate::roles::Stream;
use crate::schema::{self, WeightsAnnounce};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One JSON object per line (for jq).
    Json,
    /// One readable line per entry.
    Table,
    /// Prompts and completions as text, with each token's policy version and log-prob.
    Text,
}

pub struct ReadOptions {
    pub stream: String,
    pub from: RangeBound,
    pub to: RangeBound,
    pub count: Option<usize>,
    /// Keeps groups (and prompts, dead letters of them) whose id contains this.
    pub group_id: Option<String>,
    /// Keeps rollouts and scored groups at least this many versions behind the newest
    /// weights announced when they were written.
    pub min_staleness: Option<u64>,
    pub reward: Option<RewardFilter>,
    pub format: Format,
    /// Decodes completions for `text` (default: the built-in character tokenizer).
    pub tokenizer: Option<Tokenizer>,
}

/// Newest announced weights version at each announce id, for staleness.
pub(super) async fn announces(source: &Source) -> Result<Vec<(EntryId, u64)>, ReplayError> {
    let mut out = Vec::new();
    source
        .each(
            Stream::Weights.as_str(),
            RangeBound::Open,
            RangeBound::Open,
            |id, p| {
                if let Ok(a) = schema::decode::<WeightsAnnounce>(p) {
                    out.push((id, a.version));
                }
                true
            },
        )
        .await?;
    Ok(out)
}

pub(super) fn version_at(announces: &[(EntryId, u64)], id: EntryId) -> Option<u64> {
    let i = announces.partition_point(|(a, _)| *a <= id);
    i.checked_sub(1).map(|i| announces[i].1)
}

/// Prints matching entries to `out`; returns how many were printed.
pub async fn read(
    source: &Source,
    opts: &ReadOptions,
    out: &mut dyn std::io::Write,
) -> Result<u64, ReplayError> {
    if Stream::from_name(&opts.stream).is_none() {
        return Err(ReplayError::Usage(format!(
            "--stream {} is not one of {}",
            opts.stream,
            Stream::ALL.map(Stream::as_str).join(", ")
        )));
    }
    let announced = match opts.min_staleness {
        Some(_) => {
            let a = announces(source).await?;
            if a.is_empty() {
                return Err(ReplayError::Usage(
                    "--min-staleness needs the weights stream (announces) in the source".into(),
                ));
            }
            a
        }
        None => Vec::new(),
    };
    let char_tok = Tokenizer::Char(crate::tasks::char_tokenizer());
    let tok = opts.tokenizer.as_ref().unwrap_or(&char_tok);
    let mut shown = 0u64;
    let mut failed: Option<std::io::Error> = None;
    source
        .each(&opts.stream, opts.from, opts.to, |id, payload| {
            let m = decode(&opts.stream, payload);
            if let Some(want) = &opts.group_id
                && !group_of(&m).is_some_and(|g| g.contains(want.as_str()))
            {
                return true;
            }
            if let Some(f) = &opts.reward {
                let EntryMessage::Scored(g) = &m else {
                    return true;
                };
                if !f.keeps(mean(&g.rewards)) {
                    return true;
                }
            }
            if let Some(min) = opts.min_staleness {
                let Some(g) = rollout_of(&m) else { return true };
                let newest = version_at(&announced, id).unwrap_or(0);
                let lag = newest.saturating_sub(g.oldest_version().unwrap_or(newest));
                if lag < min {
                    return true;
                }
            }
            let text = match opts.format {
                Format::Json => json_line(&opts.stream, id, payload, &m).to_string() + "\n",
                Format::Table => table_line(id, &m) + "\n",
                Format::Text => text_block(id, &m, tok),
            };
            if let Err(e) = out.write_all(text.as_bytes()) {
                failed = Some(e);
                return false;
            }
            shown += 1;
            opts.count.is_none_or(|c| shown < c as u64)
        })
        .await?;
    match failed {
        // A closed pipe (`| head`) ends the listing; it is not an error.
        Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(ReplayError::Usage(format!("cannot write: {e}")))
        }
        _ => Ok(shown),
    }
}
