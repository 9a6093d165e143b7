//! Batched generation with an incremental KV cache and continuous batching.
//!
//! [`Generator`] holds the rows being decoded. [`Generator::admit`] prefills a prompt once
//! and starts `n` completions of it; [`Generator::step`] runs one forward pass for every
//! row and returns the completions that finished. Rows join and leave between passes
//! without disturbing the others. The model is a parameter of each call, so the caller can
//! swap in new weights between two passes: the cache is kept and later tokens are tagged
//! with the new version.
//!
//! Every sampled token comes with its behaviour log-prob under the exact distribution it
//! was drawn from (temperature, then top-k, then top-p, renormalised), and, when top-k/top-p
//! truncated the vocabulary, the ids that survived.
//!
//! **Episodes** ([`Generator::admit_episode`]): a row whose model turn ends (a stop token,
//! or the turn's token budget) is *parked* instead of finished: it leaves the batch with
//! its own KV cache, so the other rows keep decoding while the environment answers. The
//! caller takes the ended turns ([`Generator::take_turns`]), asks the environment, and
//! either [`Generator::resume`]s the row (the observation's tokens are appended as they
//! are, prefilled onto the row's cache, and the next turn is sampled) or
//! [`Generator::end`]s it. Earlier turns are never re-tokenized: the row's token ids are
//! exactly what the model saw. Weights swapped inside a turn keep the row's cache (as for
//! a single-turn row); a resumed row whose cache older weights computed is prefilled anew
//! under the current ones, so each later turn is sampled exactly as the trainer's teacher
//! forcing with its version recomputes it.

mod forward;
mod kept;
mod request;
#[cfg(test)]
mod tests;

pub use forward::PREFILL_TOKENS;
use forward::{Prefilled, checked_prompt, decode_pass, passes, prefill, prefill_together};
pub use kept::{KeptCache, Watch};
pub use request::{Completion, Drawn, Request, Resumed, Turn, TurnLimits};

use super::draw::{Draw, alternatives, sample_token};
use super::llama::{KvCache, Policy};
use super::{Kernels, ModelError};
use crate::schema::{
    FinishReason, Routing, RoutingShape, SamplingMask, SamplingParams, Span, TurnReward, VersionRun,
};
use burn::tensor::backend::Backend;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rayon::prelude::*;
use std::sync::Arc;
/// Per-row state of a completion in progress.
struct Row {
    request_id: u64,
    index: usize,
    params: SamplingParams,
    rng: StdRng,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    versions: Vec<VersionRun>,
    offsets: Vec<u32>,
    kept_ids: Vec<u32>,
    truncated: bool,
    /// Most tokens this completion may have: `max_new_tokens`, or what the context leaves
    /// after the prompt (for an episode: its episode budget, or what the context leaves).
    budget: usize,
    /// Episodes: the per-turn budget, and where the current model turn started.
    turn_tokens: Option<usize>,
    turn_start: usize,
    env: Vec<Span>,
    turn_rewards: Vec<TurnReward>,
    turns: u32,
    /// Episodes: the prompt as prefilled, and the version whose weights computed every
    /// cached position (`None` once a swap mixed two).
    prompt: Vec<u32>,
    cache_version: Option<u64>,
    /// MoE models: the routing shape, the experts of each fed completion token
    /// (`[tokens, layers, k]`), and the prompt's.
    routing_shape: Option<RoutingShape>,
    routing: Vec<u16>,
    prompt_routing: Option<Arc<Routing>>,
    /// Whether each draw is reported as it happens ([`Generator::take_drawn`]), with how
    /// many alternatives, and whether the row's cache is kept when it finishes.
    watched: Option<Watch>,
}

/// What a row does after a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    Continue,
    /// An episode's model turn ended.
    TurnEnd,
    Finished,
}

impl Row {
    /// The token the next pass feeds: the row's last.
    fn last_token(&self) -> i64 {
        i64::from(*self.tokens.last().unwrap_or(&0))
    }

    fn new(req: &Request, index: usize, budget: usize) -> Self {
        // Each sample has its own stream, so results do not depend on batch composition.
        let seed = req.params.seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        Row {
            request_id: req.id,
            index,
            params: req.params.clone(),
            rng: StdRng::seed_from_u64(seed),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            versions: Vec::new(),
            offsets: vec![0],
            kept_ids: Vec::new(),
            truncated: false,
            budget,
            turn_tokens: None,
            turn_start: 0,
            env: Vec::new(),
            turn_rewards: Vec::new(),
            turns: 0,
            prompt: Vec::new(),
            cache_version: None,
            routing_shape: None,
            routing: Vec::new(),
            prompt_routing: None,
            watched: None,
        }
    }

    /// Whether token `t` is the environment's.
    fn is_env(&self, t: usize) -> bool {
        self.env.iter().any(|s| s.range().contains(&t))
    }

    /// Records a draw; returns what the row does next.
    fn next(&mut self, draw: Draw, version: u64, vocab: usize) -> Next {
        let stop = self.params.stop_tokens.contains(&draw.token);
        if self.push(draw, version, vocab) && self.turn_tokens.is_none() {
            return Next::Finished;
        }
        let Some(turn_tokens) = self.turn_tokens else {
            return Next::Continue;
        };
        if self.tokens.len() >= self.budget {
            self.turns += 1;
            Next::Finished
        } else if stop || self.tokens.len() - self.turn_start >= turn_tokens {
            self.turns += 1;
            Next::TurnEnd
        } else {
            Next::Continue
        }
    }

    /// Appends the environment's `observation` (context: log-prob 0, an empty kept set).
    fn observe(&mut self, observation: &[u32]) {
        let start = self.tokens.len() as u32;
        self.env.push(Span {
            start,
            len: observation.len() as u32,
        });
        self.tokens.extend_from_slice(observation);
        self.logprobs
            .extend(std::iter::repeat_n(0.0, observation.len()));
        if self.truncated {
            let at = self.kept_ids.len() as u32;
            self.offsets
                .extend(std::iter::repeat_n(at, observation.len()));
        }
        self.turn_start = self.tokens.len();
    }

    /// Records a draw; returns whether the row is finished (single-turn rules).
    fn push(&mut self, draw: Draw, version: u64, vocab: usize) -> bool {
        let i = self.tokens.len() as u32;
        if self.versions.last().is_none_or(|r| r.version != version) {
            self.versions.push(VersionRun { start: i, version });
        }
        self.tokens.push(draw.token);
        self.logprobs.push(draw.logprob);
        // A row that never truncates records no mask, so the whole-vocabulary kept sets of
        // its tokens are written out only once a later token truncates (at 152k ids, 600 kB
        // per token otherwise).
        match draw.kept {
            Some(ids) => {
                if !self.truncated {
                    // Earlier model tokens kept the whole vocabulary; the environment's
                    // tokens keep nothing (they were not sampled).
                    let earlier = self.tokens.len() - 1;
                    let widths: Vec<usize> = (0..earlier)
                        .map(|k| if self.is_env(k) { 0 } else { vocab })
                        .collect();
                    self.kept_ids = widths.iter().flat_map(|&w| 0..w as u32).collect();
                    self.offsets = std::iter::once(0)
                        .chain(widths.iter().scan(0u32, |acc, &w| {
                            *acc += w as u32;
                            Some(*acc)
                        }))
                        .collect();
                    self.truncated = true;
                }
                self.kept_ids.extend(ids);
            }
            None if self.truncated => self.kept_ids.extend(0..vocab as u32),
            None => {}
        }
        if self.truncated {
            self.offsets.push(self.kept_ids.len() as u32);
        }
        self.params.stop_tokens.contains(&draw.token) || self.tokens.len() >= self.budget
    }

    fn finish(self) -> Completion {
        let stopped = self
            .tokens
            .last()
            .is_some_and(|t| self.params.stop_tokens.contains(t));
        self.finish_as(if stopped {
            FinishReason::Stop
        } else {
            FinishReason::Length
        })
    }

    fn finish_as(self, finish: FinishReason) -> Completion {
        Completion {
            request_id: self.request_id,
            index: self.index,
            tokens: self.tokens,
            logprobs: self.logprobs,
            versions: self.versions,
            finish,
            mask: self.truncated.then(|| SamplingMask {
                offsets: self.offsets.into(),
                ids: self.kept_ids.into(),
            }),
            env: self.env,
            turn_rewards: self.turn_rewards,
            turns: self.turns,
            routing: self
                .routing_shape
                .map(|shape| Routing::pack(shape, &self.routing)),
            prompt_routing: self.prompt_routing,
        }
    }
}

/// A row waiting for the environment, with its own KV cache (its last token not yet fed).
struct Parked<B: Backend> {
    row: Row,
    cache: KvCache<B>,
}

/// Records the environment's `reward` for `row`'s last turn, on its last token.
fn record(row: &mut Row, reward: Option<f32>) {
    if let (Some(reward), Some(last)) = (reward, row.tokens.len().checked_sub(1)) {
        row.turn_rewards.push(TurnReward {
            index: last as u32,
            reward,
        });
    }
}

/// Row `i` of `cache`, for `row`, which just finished: kept (see [`kept`]) when it asked
/// to be and one version computed every cached position, with its request's id.
fn kept_row<B: Kernels>(row: &Row, cache: &KvCache<B>, i: usize) -> Option<(u64, KeptCache<B>)> {
    if !row.watched.is_some_and(|w| w.keep) || row.index != 0 {
        return None;
    }
    // The prompt and every completion token but the last, which no pass has fed.
    let fed = row.tokens.len().saturating_sub(1);
    let ids = row
        .prompt
        .iter()
        .chain(&row.tokens[..fed])
        .copied()
        .collect();
    let kept = KeptCache::row(cache, i, ids, row.cache_version?)?;
    Some((row.request_id, kept))
}

/// The decode loop's state: active rows and their KV cache.
pub struct Generator<B: Backend> {
    cache: Option<KvCache<B>>,
    rows: Vec<Row>,
    /// Completions finished during `admit` (a stop token first), handed out by `step`.
    done: Vec<Completion>,
    /// Episode rows whose turn ended, waiting for the environment.
    parked: Vec<Parked<B>>,
    /// Turns ended since the last [`Generator::take_turns`].
    turns: Vec<Turn>,
    /// MoE models: the experts each row's token ran through in the last forward pass
    /// (`[rows, layers, k]`), which [`Generator::sample`] files with the rows.
    pass_routes: Option<Vec<u16>>,
    /// Tokens of watched rows drawn since the last [`Generator::take_drawn`].
    drawn: Vec<Drawn>,
    /// Caches finished rows left behind, by request ([`Generator::take_kept`]).
    kept: Vec<(u64, KeptCache<B>)>,
}

impl<B: Backend> Default for Generator<B> {
    fn default() -> Self {
        Generator {
            cache: None,
            rows: Vec::new(),
            done: Vec::new(),
            parked: Vec::new(),
            turns: Vec::new(),
            pass_routes: None,
            drawn: Vec::new(),
            kept: Vec::new(),
        }
    }
}

impl<B: Kernels> Generator<B> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Rows being decoded.
    pub fn active(&self) -> usize {
        self.rows.len()
    }

    /// No row decoding, parked or finished but not handed out.
    pub fn is_idle(&self) -> bool {
        self.rows.is_empty() && self.done.is_empty() && self.parked.is_empty()
    }

    /// Prefills `req.prompt` once and starts `req.n` completions, sampling their first
    /// tokens with `model` at `version`. Each completion ends at `max_new_tokens` or when
    /// prompt + completion fill the model's context (finish `length` either way). A prompt
    /// the model cannot take (ids past the vocabulary, no room left in the context) is
    /// refused before any tensor is built. Nothing changes unless it succeeds.
    pub fn admit(
        &mut self,
        model: &Policy<B>,
        version: u64,
        req: &Request,
    ) -> Result<(), ModelError> {
        self.start(model, version, req, None, None)
    }

    /// Like [`Generator::admit`], and every token of the request's rows is reported as it
    /// is drawn ([`Generator::take_drawn`]), for a caller that streams them, as `watch`
    /// says (alternatives, and whether the first row's cache is kept).
    pub fn admit_watched(
        &mut self,
        model: &Policy<B>,
        version: u64,
        req: &Request,
        watch: Watch,
    ) -> Result<(), ModelError> {
        self.start(model, version, req, None, Some(watch))
    }

    /// The cache `request`'s first row left behind when it finished, if it was kept.
    pub fn take_kept(&mut self, request: u64) -> Option<KeptCache<B>> {
        let at = self.kept.iter().position(|(r, _)| *r == request)?;
        Some(self.kept.swap_remove(at).1)
    }

    /// Admits `req` as [`Generator::admit_watched`] does, continuing from `kept` when
    /// `version` computed it and `req`'s prompt extends its ids, prefilling only the new
    /// tokens; otherwise (another version, a prompt that does not extend it, an MoE model,
    /// whose prompt routing would miss the cached tokens) prefilling the prompt whole.
    /// Whether the cache was continued.
    pub fn admit_continued(
        &mut self,
        model: &Policy<B>,
        version: u64,
        req: &Request,
        watch: Watch,
        kept: KeptCache<B>,
    ) -> Result<bool, ModelError> {
        let prompt = checked_prompt(model, req)?;
        if !kept.continued_by(&prompt, version) || model.config().moe.is_some() {
            self.start(model, version, req, None, Some(watch))?;
            return Ok(false);
        }
        let (held, mut cache) = (kept.ids.len(), kept.cache);
        let (last, routes) = prefill(model, &mut cache, &prompt[held..], held)?;
        let prefilled = Prefilled {
            last,
            cache,
            routes,
        };
        self.spread(model, version, req, &prompt, prefilled, None, Some(watch));
        Ok(true)
    }

    /// The tokens of watched rows drawn since the last call, in the order drawn.
    pub fn take_drawn(&mut self) -> Vec<Drawn> {
        std::mem::take(&mut self.drawn)
    }

    /// Notes `row`'s last draw, from `logits`, when the row is watched.
    fn note(&mut self, row: &Row, version: u64, logits: &[f32]) {
        if let (Some(w), Some(&token), Some(&logprob)) =
            (row.watched, row.tokens.last(), row.logprobs.last())
        {
            self.drawn.push(Drawn {
                request_id: row.request_id,
                index: row.index,
                token,
                logprob,
                version,
                alternatives: alternatives(logits, &row.params, w.alternatives),
            });
        }
    }

    /// Ends row `index` of `request` now, wherever it is (decoding, finished, parked), with
    /// `finish`: its completion as it stands, its cache row freed. `None` when there is no
    /// such row.
    pub fn finish_row(
        &mut self,
        request: u64,
        index: usize,
        finish: FinishReason,
    ) -> Option<Completion> {
        if let Some(at) = self
            .done
            .iter()
            .position(|c| c.request_id == request && c.index == index)
        {
            let mut c = self.done.swap_remove(at);
            c.finish = finish;
            return Some(c);
        }
        if let Some(p) = self.unpark(request, index) {
            return Some(p.row.finish_as(finish));
        }
        let at = self
            .rows
            .iter()
            .position(|r| r.request_id == request && r.index == index)?;
        let row = self.rows.remove(at);
        let kept = self.cache.as_ref().and_then(|c| kept_row(&row, c, at));
        self.kept.extend(kept);
        let keep: Vec<usize> = (0..=self.rows.len()).filter(|&i| i != at).collect();
        match self.cache.as_mut() {
            Some(c) if !keep.is_empty() => c.keep_rows(&keep),
            _ => self.cache = None,
        }
        Some(row.finish_as(finish))
    }

    /// Like [`Generator::admit`], for `req.n` episodes: each model turn ends on a stop
    /// token or after `limits.turn_tokens` tokens and is then parked for the environment
    /// (see the module docs); `max_new_tokens` does not apply, the episode ends (finish
    /// `length`) when it reaches `limits.episode_tokens` or the context.
    pub fn admit_episode(
        &mut self,
        model: &Policy<B>,
        version: u64,
        req: &Request,
        limits: TurnLimits,
    ) -> Result<(), ModelError> {
        self.start(model, version, req, Some(limits), None)
    }

    /// Admits every request of `reqs` as [`Generator::admit`] does, their prompts prefilled
    /// together: prompts of similar lengths share one pass (shorter ones left-padded, the
    /// padding masked out; at most [`PREFILL_TOKENS`] tokens a pass), so each weight is read
    /// once a pass for all of them. Each completion is the bits it would be admitted alone:
    /// every row's products, norms and attention are its own. Nothing changes unless every
    /// request is admitted; a prompt the model cannot take refuses the whole call before any
    /// tensor is built.
    pub fn admit_all(
        &mut self,
        model: &Policy<B>,
        version: u64,
        reqs: &[Request],
    ) -> Result<(), ModelError> {
        self.start_all(model, version, reqs, None)
    }

    /// [`Generator::admit_all`] with every row watched, as [`Generator::admit_watched`]:
    /// the rows of `reqs[i]` as `watches[i]` says.
    pub fn admit_all_watched(
        &mut self,
        model: &Policy<B>,
        version: u64,
        reqs: &[Request],
        watches: &[Watch],
    ) -> Result<(), ModelError> {
        self.start_all(model, version, reqs, Some(watches))
    }

    fn start_all(
        &mut self,
        model: &Policy<B>,
        version: u64,
        reqs: &[Request],
        watched: Option<&[Watch]>,
    ) -> Result<(), ModelError> {
        let prompts = reqs
            .iter()
            .map(|r| checked_prompt(model, r))
            .collect::<Result<Vec<_>, _>>()?;
        let began = std::time::Instant::now();
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by_key(|&i| prompts[i].len());
        let mut prefilled = Vec::with_capacity(reqs.len());
        let passes = passes(&order, |i| prompts[i].len());
        let passes_run = passes.len();
        for pass in passes {
            let feeds: Vec<&[u32]> = pass.iter().map(|&i| prompts[i].as_slice()).collect();
            prefilled.extend(pass.iter().copied().zip(prefill_together(model, &feeds)?));
        }
        let prefill_ms = began.elapsed().as_millis() as u64;
        prefilled.sort_by_key(|(i, _)| *i);
        for (i, p) in prefilled {
            let watch = watched.map(|w| w.get(i).copied().unwrap_or_default());
            self.spread(model, version, &reqs[i], &prompts[i], p, None, watch);
        }
        tracing::debug!(
            prompts = reqs.len(),
            passes = passes_run,
            tokens = prompts.iter().map(Vec::len).sum::<usize>(),
            prefill_ms,
            ms = began.elapsed().as_millis() as u64,
            "prompts admitted together"
        );
        Ok(())
    }

    fn start(
        &mut self,
        model: &Policy<B>,
        version: u64,
        req: &Request,
        episode: Option<TurnLimits>,
        watched: Option<Watch>,
    ) -> Result<(), ModelError> {
        let prompt = checked_prompt(model, req)?;
        for p in prefill_together(model, &[prompt.as_slice()])? {
            self.spread(model, version, req, &prompt, p, episode, watched);
        }
        Ok(())
    }

    /// Starts `req.n` rows from a prefilled prompt: samples their first tokens and adds
    /// the rows that go on to the batch (parks or finishes the others).
    #[allow(clippy::too_many_arguments)]
    fn spread(
        &mut self,
        model: &Policy<B>,
        version: u64,
        req: &Request,
        prompt_ids: &[u32],
        prefilled: Prefilled<B>,
        episode: Option<TurnLimits>,
        watched: Option<Watch>,
    ) {
        let vocab = model.config().vocab_size;
        let room = model.config().max_position.saturating_sub(prompt_ids.len());
        let budget = match episode {
            None => (req.params.max_new_tokens as usize).min(room),
            Some(t) => t.episode_tokens.min(room),
        };
        let Prefilled {
            last,
            mut cache,
            routes,
        } = prefilled;
        let shape = model.config().routing_shape();
        let prompt_routing = shape
            .zip(routes)
            .map(|(s, used)| Arc::new(Routing::pack(s, &used)));
        cache.repeat_rows(req.n);
        let (mut keep, mut rows) = (Vec::new(), Vec::new());
        for i in 0..req.n {
            let mut row = Row::new(req, i, budget);
            row.routing_shape = shape;
            row.prompt_routing = prompt_routing.clone();
            row.turn_tokens = episode.map(|t| t.turn_tokens.max(1));
            row.watched = watched;
            if episode.is_some() || watched.is_some_and(|w| w.keep) {
                row.prompt = prompt_ids.to_vec();
                row.cache_version = Some(version);
            }
            let draw = sample_token(&last, &row.params, &mut row.rng);
            let next = row.next(draw, version, vocab);
            self.note(&row, version, &last);
            match next {
                Next::Finished => {
                    self.kept.extend(kept_row(&row, &cache, i));
                    self.done.push(row.finish());
                }
                Next::TurnEnd => self.park(row, &cache, i),
                Next::Continue => {
                    keep.push(i);
                    rows.push(row);
                }
            }
        }
        if keep.is_empty() {
            return;
        }
        cache.keep_rows(&keep);
        self.join(rows, cache);
    }

    /// Adds `rows` (with their cache) to the batch.
    fn join(&mut self, rows: Vec<Row>, cache: KvCache<B>) {
        match &mut self.cache {
            Some(c) if !self.rows.is_empty() => c.append_rows(cache),
            slot => *slot = Some(cache),
        }
        self.rows.extend(rows);
    }

    /// Parks `row`, whose turn just ended, with row `i` of `cache`.
    fn park(&mut self, row: Row, cache: &KvCache<B>, i: usize) {
        let mut own = cache.clone();
        own.keep_rows(&[i]);
        self.turns.push(Turn {
            request_id: row.request_id,
            index: row.index,
            tokens: row.tokens[row.turn_start..].to_vec(),
            stopped: row
                .tokens
                .last()
                .is_some_and(|t| row.params.stop_tokens.contains(t)),
            number: row.turns,
        });
        self.parked.push(Parked { row, cache: own });
    }

    /// Episode turns that ended since the last call, each waiting for
    /// [`Generator::resume`] or [`Generator::end`].
    pub fn take_turns(&mut self) -> Vec<Turn> {
        std::mem::take(&mut self.turns)
    }

    /// Completions that finished outside a forward pass (while being admitted), handed out
    /// by the next [`Generator::step`] or here.
    pub fn take_done(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.done)
    }

    /// Episode rows waiting for the environment.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    fn unpark(&mut self, request_id: u64, index: usize) -> Option<Parked<B>> {
        let at = self
            .parked
            .iter()
            .position(|p| p.row.request_id == request_id && p.row.index == index)?;
        self.turns
            .retain(|t| !(t.request_id == request_id && t.index == index));
        Some(self.parked.swap_remove(at))
    }

    /// Continues a parked episode: records `reward` on its last turn's last token, appends
    /// `observation` (the environment's tokens, never re-tokenized), prefills the turn's
    /// unfed last token and the observation onto the row's own cache with `model` (the
    /// whole episode onto a new cache when weights changed since the cache was computed),
    /// and samples the next turn's first token at `version`. `None` when no such row is
    /// parked. The observation must hold ids inside the vocabulary.
    pub fn resume(
        &mut self,
        request_id: u64,
        index: usize,
        reward: Option<f32>,
        observation: &[u32],
        model: &Policy<B>,
        version: u64,
    ) -> Result<Option<Resumed>, ModelError> {
        model
            .config()
            .limits()
            .ids("observation", observation)
            .map_err(ModelError::Refused)?;
        let Some(Parked { mut row, mut cache }) = self.unpark(request_id, index) else {
            return Ok(None);
        };
        record(&mut row, reward);
        if row.tokens.len() + observation.len() + 1 > row.budget {
            return Ok(Some(Resumed::Finished(Box::new(
                row.finish_as(FinishReason::Length),
            ))));
        }
        let last = *row.tokens.last().unwrap_or(&0);
        // A cache computed by other weights than `version` (a swap since the episode
        // started) is rebuilt: the next turn then sees the episode so far exactly as the
        // trainer's teacher forcing with `version` will. Otherwise only the turn's unfed
        // last token and the observation are prefilled.
        let fresh = row.cache_version != Some(version);
        let feed: Vec<u32> = if fresh {
            cache = model.empty_cache(1);
            row.prompt
                .iter()
                .chain(&row.tokens)
                .chain(observation)
                .copied()
                .collect()
        } else {
            std::iter::once(last)
                .chain(observation.iter().copied())
                .collect()
        };
        row.observe(observation);
        row.cache_version = Some(version);
        let p = if fresh { 0 } else { cache.next_positions()[0] };
        let (logits, routes) = prefill(model, &mut cache, &feed, p)?;
        // A token's routing is the one of its first feed: of a rebuilt cache's pass, only
        // the newly fed tokens (the turn's last token and the observation) are kept.
        if let Some(used) = routes {
            let per = used.len() / feed.len().max(1);
            let tail = used.len().saturating_sub((1 + observation.len()) * per);
            row.routing.extend_from_slice(&used[tail..]);
        }
        let vocab = model.config().vocab_size;
        let draw = sample_token(&logits, &row.params, &mut row.rng);
        let next = row.next(draw, version, vocab);
        self.note(&row, version, &logits);
        Ok(Some(match next {
            Next::Finished => Resumed::Finished(Box::new(row.finish())),
            Next::TurnEnd => {
                self.park(row, &cache, 0);
                Resumed::Parked
            }
            Next::Continue => {
                self.join(vec![row], cache);
                Resumed::Decoding
            }
        }))
    }

    /// Ends a parked episode with `finish`, recording `reward` on its last turn. `None`
    /// when no such row is parked.
    pub fn end(
        &mut self,
        request_id: u64,
        index: usize,
        reward: Option<f32>,
        finish: FinishReason,
    ) -> Option<Completion> {
        let Parked { mut row, .. } = self.unpark(request_id, index)?;
        record(&mut row, reward);
        Some(row.finish_as(finish))
    }

    /// Request id of each active row, in row order.
    pub fn row_requests(&self) -> Vec<u64> {
        self.rows.iter().map(|r| r.request_id).collect()
    }

    /// One forward pass for every row, returning the host logits `[rows, vocab]`, or `None`
    /// with no row active. It extends the KV cache: a caller that may need to discard the
    /// pass takes a [`Generator::snapshot`] first.
    pub fn forward(&mut self, model: &Policy<B>) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(cache) = self.cache.as_mut().filter(|_| !self.rows.is_empty()) else {
            return Ok(None);
        };
        let last = self.rows.iter().map(Row::last_token).collect();
        let (host, routes) = decode_pass(model, cache, last)?;
        self.pass_routes = routes;
        Ok(Some(host))
    }

    /// The KV cache as it is now (tensor handles, no copy), for [`Generator::restore`].
    pub fn snapshot(&self) -> Option<KvCache<B>> {
        self.cache.clone()
    }

    /// Puts back a cache taken by [`Generator::snapshot`] before a discarded pass.
    pub fn restore(&mut self, cache: Option<KvCache<B>>) {
        self.cache = cache;
        self.pass_routes = None;
    }

    /// Runs row `i` alone through one forward pass on a copy of its cache: how a caller
    /// finds which row made a batched pass fail. Changes nothing.
    pub fn probe_row(&self, model: &Policy<B>, i: usize) -> Result<(), ModelError> {
        let (Some(cache), Some(row)) = (self.cache.as_ref(), self.rows.get(i)) else {
            return Ok(());
        };
        let mut one = cache.clone();
        one.keep_rows(&[i]);
        decode_pass(model, &mut one, vec![row.last_token()]).map(|_| ())
    }

    /// Drops every row of `request` (a failed prompt), with its cache rows.
    pub fn drop_request(&mut self, request: u64) {
        let keep: Vec<usize> = (0..self.rows.len())
            .filter(|&i| self.rows[i].request_id != request)
            .collect();
        self.done.retain(|c| c.request_id != request);
        self.drawn.retain(|d| d.request_id != request);
        self.parked.retain(|p| p.row.request_id != request);
        self.turns.retain(|t| t.request_id != request);
        if keep.len() == self.rows.len() {
            return;
        }
        let rows = std::mem::take(&mut self.rows);
        self.rows = rows
            .into_iter()
            .filter(|r| r.request_id != request)
            .collect();
        match self.cache.as_mut() {
            Some(c) if !keep.is_empty() => c.keep_rows(&keep),
            _ => self.cache = None,
        }
    }

    /// Samples each row's next token from `host` (the logits of [`Generator::forward`],
    /// made by `model` at `version`); returns the completions that finished, including any
    /// that finished while being admitted.
    pub fn sample(&mut self, host: &[f32], version: u64, vocab: usize) -> Vec<Completion> {
        let b = self.rows.len();
        let mut finished = std::mem::take(&mut self.done);
        let mut keep = Vec::with_capacity(b);
        let mut still = Vec::with_capacity(b);
        let mut ended = Vec::new();
        let routes = self.pass_routes.take();
        let per = routes.as_ref().map_or(0, |r| r.len() / b.max(1));
        let mut rows = std::mem::take(&mut self.rows);
        // Each row draws from its own logits with its own generator: the rows in parallel.
        let draws: Vec<Draw> = rows
            .par_iter_mut()
            .zip(host.par_chunks(vocab.max(1)))
            .map(|(row, logits)| sample_token(logits, &row.params, &mut row.rng))
            .collect();
        for (i, ((mut row, draw), logits)) in rows
            .into_iter()
            .zip(draws)
            .zip(host.chunks(vocab.max(1)))
            .enumerate()
        {
            if let Some(r) = &routes {
                row.routing.extend_from_slice(&r[i * per..(i + 1) * per]);
            }
            // This pass fed the row's last token with the weights of `version`.
            row.cache_version = row.cache_version.filter(|&v| v == version);
            let next = row.next(draw, version, vocab);
            self.note(&row, version, logits);
            match next {
                Next::Finished => {
                    let kept = self.cache.as_ref().and_then(|c| kept_row(&row, c, i));
                    self.kept.extend(kept);
                    finished.push(row.finish());
                }
                Next::TurnEnd => ended.push((i, row)),
                Next::Continue => {
                    keep.push(i);
                    still.push(row);
                }
            }
        }
        if let Some(cache) = self.cache.take() {
            for (i, row) in ended {
                self.park(row, &cache, i);
            }
            self.cache = Some(cache);
        }
        self.rows = still;
        if let Some(cache) = self.cache.as_mut()
            && keep.len() < b
        {
            cache.keep_rows(&keep);
        }
        if self.rows.is_empty() {
            self.cache = None;
        }
        finished
    }

    /// One forward pass for every row with `model` (tagged `version`), then sampling.
    /// Returns the completions that finished, including any that finished while being
    /// admitted.
    pub fn step(&mut self, model: &Policy<B>, version: u64) -> Result<Vec<Completion>, ModelError> {
        match self.forward(model)? {
            Some(host) => Ok(self.sample(&host, version, model.config().vocab_size)),
            None => Ok(std::mem::take(&mut self.done)),
        }
    }

    /// Runs `requests` to completion (all admitted at once) with a fixed model.
    pub fn generate(
        model: &Policy<B>,
        version: u64,
        requests: &[Request],
    ) -> Result<Vec<Completion>, ModelError> {
        let mut g = Generator::new();
        g.admit_all(model, version, requests)?;
        let mut out = Vec::new();
        while !g.is_idle() {
            out.extend(g.step(model, version)?);
        }
        out.sort_by_key(|c| (c.request_id, c.index));
        Ok(out)
    }
}
