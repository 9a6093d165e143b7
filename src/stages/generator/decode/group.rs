//! What the two stream sources (plain prompts and episodes) share: prompts as the reader
//! hands them over, the reads they arrive in, and the groups being decoded until every row
//! is in and the group goes to the publisher.

use super::inbox::{self, Doorbell, Inbox, Sender, Stopped};
use super::source::{Panicked, Rows, Waiting};
use crate::bus::{Entry, EntryId};
use crate::env::{self, EnvError};
use crate::model::ModelError;
use crate::model::fault;
use crate::model::sampler::{Completion, Generator, Request};
use crate::model::{InferBackend, Policy};
use crate::schema::{self, Prompt, RolloutGroup, Sample, SamplingParams};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// A prompt on its way to the decode thread: its entry as read (for a dead letter), the
/// message and the ids to decode from.
pub struct Admit {
    pub source: Entry,
    pub prompt: Prompt,
    pub tokens: Vec<u32>,
}

/// A finished group on its way to the publisher.
pub struct Finished {
    pub entry: EntryId,
    pub group: RolloutGroup,
}

/// A prompt the model could not run, to be dead-lettered by the reader.
pub struct Failed {
    pub source: Entry,
    pub reason: &'static str,
    pub detail: String,
}

/// What the decode thread hands the publisher.
pub enum Decoded {
    Group(Finished),
    Failed(Failed),
}

/// What the reader hands a stream source.
pub enum FromReader {
    Prompt(Box<Admit>),
    /// The prompts of one read have all been handed over.
    ReadEnd,
}

/// The reader's side of the stream sources: a prompt whose meta names an environment goes
/// to the episodes, any other to the plain prompts; the end of a read to both.
#[derive(Clone)]
pub struct PromptSender {
    prompts: Sender<FromReader>,
    episodes: Sender<FromReader>,
}

impl PromptSender {
    /// The sender and the two inboxes it feeds: (plain prompts, episodes).
    pub fn new(bell: &Arc<Doorbell>) -> (Self, Inbox<FromReader>, Inbox<FromReader>) {
        let (prompts, plain) = inbox::inbox(bell);
        let (episodes, played) = inbox::inbox(bell);
        (PromptSender { prompts, episodes }, plain, played)
    }

    /// Hands `a` over; `Err` when the decode thread has stopped.
    pub fn prompt(&self, a: Admit) -> Result<(), Stopped> {
        let to = if env::is_episode(&a.prompt.meta) {
            &self.episodes
        } else {
            &self.prompts
        };
        to.send(FromReader::Prompt(Box::new(a)))
            .map_err(|_| Stopped)
    }

    /// Says a read's prompts have all been handed over.
    pub fn read_end(&self) -> Result<(), Stopped> {
        self.prompts
            .send(FromReader::ReadEnd)
            .map_err(|_| Stopped)?;
        self.episodes.send(FromReader::ReadEnd).map_err(|_| Stopped)
    }
}

/// Prompts received and not yet admitted, and whether the read they came in has ended.
pub struct Queue {
    inbox: Inbox<FromReader>,
    waiting: VecDeque<Admit>,
    read_ended: bool,
}

impl Queue {
    pub fn new(inbox: Inbox<FromReader>) -> Self {
        Queue {
            inbox,
            waiting: VecDeque::new(),
            read_ended: true,
        }
    }

    pub fn receive(&mut self) {
        for m in self.inbox.drain() {
            match m {
                FromReader::Prompt(a) => {
                    self.waiting.push_back(*a);
                    self.read_ended = false;
                }
                FromReader::ReadEnd => self.read_ended = true,
            }
        }
    }

    pub fn waiting(&self) -> Waiting {
        match (self.waiting.is_empty(), self.read_ended) {
            (true, _) => Waiting::Nothing,
            (false, false) => Waiting::Arriving,
            (false, true) => Waiting::Ready,
        }
    }

    /// The next prompt when `n` more rows fit.
    pub fn next(&mut self, rows: &Rows<'_>, n: usize) -> Option<Admit> {
        if rows.fit(n) {
            self.waiting.pop_front()
        } else {
            None
        }
    }

    /// The prompts waiting, first come first, while their `n` rows each fit beside the
    /// batch (to be admitted together).
    pub fn all_that_fit(&mut self, rows: &Rows<'_>, n: usize) -> Vec<Admit> {
        let mut out = Vec::new();
        while !self.waiting.is_empty() && rows.fit((out.len() + 1) * n) {
            out.extend(self.waiting.pop_front());
        }
        out
    }
}

/// What became of one of a prompt's G rows.
pub enum RowEnd {
    Done(Box<Completion>),
    /// An episode its environment failed: left out of the group.
    Failed(EnvError),
}

/// A prompt being decoded: its G completions as they finish.
struct Pending {
    source: Entry,
    prompt: Prompt,
    tokens: Vec<u32>,
    params: SamplingParams,
    started_us: u64,
    done: Vec<Option<RowEnd>>,
}

impl Pending {
    /// The group of the rows that finished, or the first failure when every one failed.
    fn into_group(self, gen_id: &str) -> Result<RolloutGroup, (Entry, EnvError)> {
        let mut failure = None;
        let mut samples = Vec::new();
        let mut prompt_routing = None;
        for slot in self.done.into_iter().flatten() {
            match slot {
                RowEnd::Done(mut c) => {
                    if let Some(r) = c.prompt_routing.take() {
                        prompt_routing.get_or_insert(r);
                    }
                    samples.push(Sample::from(*c));
                }
                RowEnd::Failed(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        if samples.is_empty() {
            let e = failure.unwrap_or_else(|| EnvError::Step("no episode finished".into()));
            return Err((self.source, e));
        }
        Ok(RolloutGroup {
            schema: RolloutGroup::version_for(&samples),
            // Stable per prompt entry: a prompt generated twice (after a crash) yields the
            // same group id, and the trainer trains it once.
            group_id: format!("{}@{}", self.prompt.prompt_id, self.source.id),
            prompt_id: self.prompt.prompt_id,
            task: self.prompt.task,
            prompt_tokens: self.tokens.into(),
            samples,
            sampling: self.params,
            gen_id: gen_id.to_string(),
            started_us: self.started_us,
            finished_us: schema::now_us(),
            meta: self.prompt.meta,
            prompt_routing: prompt_routing.map(Arc::unwrap_or_clone),
        })
    }
}

/// How a stream source samples: the stage's settings, with a seed per prompt.
#[derive(Clone)]
pub struct GroupSampling {
    /// The stage's sampling, its seed the policy's: each prompt's seed is derived from it.
    pub params: SamplingParams,
    pub group_size: usize,
}

/// The groups a stream source is decoding, and where finished ones go.
pub struct Groups {
    gen_id: String,
    sampling: GroupSampling,
    pending: HashMap<u64, Pending>,
    out: UnboundedSender<Decoded>,
    closed: bool,
}

impl Groups {
    pub fn new(gen_id: &str, sampling: GroupSampling, out: UnboundedSender<Decoded>) -> Self {
        Groups {
            gen_id: gen_id.to_string(),
            sampling,
            pending: HashMap::new(),
            out,
            closed: false,
        }
    }

    pub fn group_size(&self) -> usize {
        self.sampling.group_size
    }

    fn send(&mut self, d: Decoded) {
        self.closed |= self.out.send(d).is_err();
    }

    pub fn closed(&self) -> bool {
        self.closed
    }

    pub fn busy(&self) -> bool {
        !self.pending.is_empty()
    }

    pub fn owns(&self, request: u64) -> bool {
        self.pending.contains_key(&request)
    }

    pub fn label(&self, request: u64) -> Option<&str> {
        self.pending
            .get(&request)
            .map(|p| p.prompt.prompt_id.as_str())
    }

    /// Hands `source` back to the reader as failed (it dead-letters it).
    pub fn refuse(&mut self, source: Entry, prompt_id: &str, reason: &'static str, detail: String) {
        tracing::warn!(prompt = %prompt_id, reason, %detail, "prompt refused");
        self.send(Decoded::Failed(Failed {
            source,
            reason,
            detail,
        }));
    }

    /// Starts G rows of `a` with `prefill` (its prefill runs now, for this prompt alone):
    /// the request id once admitted, `None` when the model refused the prompt or its
    /// prefill panicked (the prompt is then handed back as failed).
    pub fn start(
        &mut self,
        rows: &mut Rows<'_>,
        a: Admit,
        prefill: impl FnOnce(
            &mut Generator<InferBackend>,
            &Policy<InferBackend>,
            u64,
            &Request,
        ) -> Result<(), ModelError>,
    ) -> Result<Option<u64>, ModelError> {
        let req = self.request(rows, &a);
        let (reason, detail) = match rows.prefill(|g, model, v| prefill(g, model, v, &req)) {
            Ok(Ok(())) => {
                self.admitted(a, &req);
                return Ok(Some(req.id));
            }
            Ok(Err(ModelError::Refused(r))) => (r.reason, r.detail),
            Ok(Err(e)) => return Err(e),
            Err(panic) => (fault::PANIC, format!("the prefill panicked: {panic}")),
        };
        self.refuse(a.source, &a.prompt.prompt_id, reason, detail);
        Ok(None)
    }

    /// Starts G rows of each of `admits`, their prompts prefilled together
    /// ([`Generator::admit_all`]); when that fails (a prompt refused, a panic), each is
    /// started alone, so that only the prompt at fault is handed back.
    pub fn start_all(&mut self, rows: &mut Rows<'_>, admits: Vec<Admit>) -> Result<(), ModelError> {
        if admits.len() > 1 {
            let reqs: Vec<Request> = admits.iter().map(|a| self.request(rows, a)).collect();
            if let Ok(Ok(())) = rows.prefill(|g, model, v| g.admit_all(model, v, &reqs)) {
                for (a, req) in admits.into_iter().zip(&reqs) {
                    self.admitted(a, req);
                }
                return Ok(());
            }
        }
        for a in admits {
            self.start(rows, a, |g, model, version, req| {
                g.admit(model, version, req)
            })?;
        }
        Ok(())
    }

    /// The request for G rows of `a`, with a new id.
    fn request(&self, rows: &mut Rows<'_>, a: &Admit) -> Request {
        Request {
            id: rows.new_request(),
            prompt: a.tokens.clone(),
            n: self.sampling.group_size,
            params: SamplingParams {
                // From the prompt's identity, not its entry id: a rerun with the same seed
                // samples the same completions (see `crate::seed`).
                seed: crate::seed::derive(self.sampling.params.seed, &a.prompt.prompt_id),
                ..self.sampling.params.clone()
            },
        }
    }

    /// Notes `a`, admitted as `req`, as pending.
    fn admitted(&mut self, a: Admit, req: &Request) {
        let pending = Pending {
            source: a.source,
            prompt: a.prompt,
            tokens: a.tokens,
            params: req.params.clone(),
            started_us: schema::now_us(),
            done: (0..req.n).map(|_| None).collect(),
        };
        self.pending.insert(req.id, pending);
    }

    /// Records what became of row `index` of `request`; the group goes out once every row
    /// is in.
    pub fn settle(&mut self, request: u64, index: usize, end: RowEnd) {
        let Some(p) = self.pending.get_mut(&request) else {
            return;
        };
        let Some(slot) = p.done.get_mut(index) else {
            return;
        };
        *slot = Some(end);
        if !p.done.iter().all(Option::is_some) {
            return;
        }
        let Some(p) = self.pending.remove(&request) else {
            return;
        };
        let entry = p.source.id;
        let decoded = match p.into_group(&self.gen_id) {
            Ok(group) => Decoded::Group(Finished { entry, group }),
            Err((source, e)) => Decoded::Failed(Failed {
                source,
                reason: e.reason(),
                detail: format!("every episode of the group failed; the first: {e}"),
            }),
        };
        self.send(decoded);
    }

    /// Fails the prompt of `request`, whose forward pass panicked.
    pub fn panicked(&mut self, request: u64, how: &Panicked<'_>) {
        let Some(p) = self.pending.remove(&request) else {
            return;
        };
        let panic = how.message;
        let detail = if how.alone {
            format!("its forward pass panicked, alone as in its batch: {panic}")
        } else {
            format!("a batched forward pass panicked and no row panicked alone: {panic}")
        };
        self.send(Decoded::Failed(Failed {
            source: p.source,
            reason: fault::PANIC,
            detail,
        }));
    }
}
