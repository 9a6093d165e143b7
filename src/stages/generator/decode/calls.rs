//! Calls from the endpoint (`gen --serve`) as a row source: a prompt's ids,
//! how to sample it, and a channel back on which each token is reported as it is drawn.
//!
//! A call's rows are decoded in the same batch as the stream's prompts, on the same model
//! and under the same weight swaps, so every token carries the version that drew it. A call
//! whose channel is closed (its client went away) is dropped with its KV rows before the
//! next forward pass. A call of a recorded episode leaves its first row's KV cache behind
//! ([`super::kept`]), and the episode's next call continues from it when it extends it.

use super::inbox::{self, Doorbell, Inbox, Sender};
use super::kept::EpisodeCaches;
use super::source::{Panicked, RowSource, Rows, Waiting};
use super::text::TextStream;
use crate::model::ModelError;
use crate::model::sampler::{Completion, Drawn, Request, Watch};
use crate::model::tokenizer::Tokenizer;
use crate::schema::{FinishReason, SamplingParams};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// One call: `n` completions of `prompt`.
pub struct Call {
    pub prompt: Vec<u32>,
    pub n: usize,
    pub params: SamplingParams,
    /// Strings that end a completion (the text before the first one is kept; the token that
    /// completed it is the completion's last).
    pub stop: Vec<String>,
    /// How many of the likeliest ids to list beside each token (0: none).
    pub alternatives: usize,
    /// The recorded episode the call belongs to: its first choice's cache is kept for the
    /// episode's next call.
    pub episode: Option<String>,
    pub events: UnboundedSender<CallEvent>,
}

/// What the endpoint hands the decode thread.
pub enum CallMessage {
    /// A call to decode.
    Call(Call),
    /// The episode closed: its kept cache is freed.
    Forget(String),
}

/// What the decode thread reports about a call.
#[derive(Debug)]
pub enum CallEvent {
    /// Row `index` drew `token` with the weights of `version`; `text` is the completion's
    /// new text that can be shown (text that could begin a stop string is held back).
    Token {
        index: usize,
        token: u32,
        logprob: f32,
        version: u64,
        text: String,
        /// The call's alternatives to the token ([`Call::alternatives`] of them at most).
        alternatives: Vec<(u32, f32)>,
    },
    /// Row `index` ended: the generator's record of it (every token with its log-prob and
    /// version runs, the kept sets when sampling truncated), and the rest of its text.
    Finished {
        index: usize,
        finish: FinishReason,
        completion: Box<Completion>,
        text: String,
    },
    /// The model cannot run the prompt (ids past the vocabulary, no room in the context).
    Refused {
        reason: &'static str,
        detail: String,
    },
    /// A forward pass failed on this call's rows; they are gone.
    Failed(String),
}

/// Where the endpoint hands its calls to the decode thread.
pub type CallSender = Sender<CallMessage>;

/// A call being decoded: where its tokens go, each row's text, the rows not yet ended.
struct Serving {
    episode: Option<String>,
    events: UnboundedSender<CallEvent>,
    texts: Vec<TextStream>,
    open: usize,
}

/// The endpoint's calls as a row source: first come, first admitted, each streamed token
/// by token with the version that drew it.
pub struct CallSource {
    inbox: Inbox<CallMessage>,
    /// The recorded episodes' caches, kept between their calls.
    kept: EpisodeCaches,
    /// Calls waiting for rows.
    queued: VecDeque<Call>,
    calls: HashMap<u64, Serving>,
    /// Rows the calls hold, as last reported.
    served_rows: usize,
    /// The model's tokenizer: each row's text as its tokens arrive.
    tokenizer: Arc<Tokenizer>,
}

impl CallSource {
    /// The source and the sender the endpoint hands its calls to.
    pub fn new(
        bell: &Arc<Doorbell>,
        tokenizer: Arc<Tokenizer>,
        kept: EpisodeCaches,
    ) -> (CallSender, Self) {
        let (tx, inbox) = inbox::inbox(bell);
        let source = CallSource {
            inbox,
            kept,
            queued: VecDeque::new(),
            calls: HashMap::new(),
            served_rows: 0,
            tokenizer,
        };
        (tx, source)
    }

    /// Notes `call`, admitted as request `id`, as being served.
    fn serve(&mut self, id: u64, call: Call) {
        let texts = (0..call.n).map(|_| TextStream::new(call.stop.clone()));
        let serving = Serving {
            episode: call.episode,
            events: call.events,
            texts: texts.collect(),
            open: call.n,
        };
        self.calls.insert(id, serving);
    }

    /// Starts decoding a call (its prefill runs now); the call hears why when the model
    /// refuses it.
    fn start(&mut self, rows: &mut Rows<'_>, call: Call) -> Result<(), ModelError> {
        if call.events.is_closed() {
            return Ok(());
        }
        let req = Request {
            id: rows.new_request(),
            prompt: call.prompt.clone(),
            n: call.n,
            params: call.params.clone(),
        };
        let watch = self.watch(&call);
        let kept = call.episode.as_deref().and_then(|e| self.kept.take(e));
        let admitted = rows.prefill(|g, model, v| match kept {
            Some(kept) => g.admit_continued(model, v, &req, watch, kept),
            None => g.admit_watched(model, v, &req, watch).map(|()| false),
        });
        let refused = match admitted {
            Ok(Ok(continued)) => {
                if call.episode.is_some() {
                    let outcome = if continued { "continued" } else { "prefilled" };
                    crate::metrics::episode_cache(outcome, 1);
                }
                self.serve(req.id, call);
                return Ok(());
            }
            Ok(Err(ModelError::Refused(r))) => CallEvent::Refused {
                reason: r.reason,
                detail: r.detail,
            },
            Ok(Err(e)) => return Err(e),
            Err(panic) => CallEvent::Failed(format!("the prefill panicked: {panic}")),
        };
        let _ = call.events.send(refused);
        Ok(())
    }

    /// How `call`'s rows are watched: its alternatives, and for a recorded episode's call
    /// (when caches are kept) its first row's cache kept.
    fn watch(&self, call: &Call) -> Watch {
        Watch {
            alternatives: call.alternatives,
            keep: call.episode.is_some() && self.kept.enabled(),
        }
    }
}

impl RowSource for CallSource {
    fn receive(&mut self) {
        for message in self.inbox.drain() {
            match message {
                CallMessage::Call(call) => self.queued.push_back(call),
                CallMessage::Forget(episode) => self.kept.forget(&episode),
            }
        }
        self.kept.sweep();
    }

    fn waiting(&self) -> Waiting {
        if self.queued.is_empty() {
            Waiting::Nothing
        } else {
            Waiting::Ready
        }
    }

    fn busy(&self) -> bool {
        !self.calls.is_empty()
    }

    /// Drops the calls whose client went away, with their rows.
    fn prepare(&mut self, rows: &mut Rows<'_>) -> Result<(), ModelError> {
        self.queued.retain(|c| !c.events.is_closed());
        let gone: Vec<u64> = self
            .calls
            .iter()
            .filter(|(_, c)| c.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            rows.generator().drop_request(id);
            self.calls.remove(&id);
            tracing::debug!(call = id, "a call's client went away: its rows are dropped");
        }
        Ok(())
    }

    /// Admits the calls that fit, first come first, their prompts prefilled together
    /// ([`crate::model::sampler::Generator::admit_all`]); when that fails (a prompt refused,
    /// a panic), each is started alone, so that only the call at fault hears why. A call
    /// that continues its episode's kept cache is started alone, on that cache.
    fn admit(&mut self, rows: &mut Rows<'_>) -> Result<(), ModelError> {
        let mut calls = Vec::new();
        let mut taking = 0;
        while let Some(c) = self.queued.front()
            && rows.fit(taking + c.n)
        {
            taking += c.n;
            calls.extend(self.queued.pop_front());
        }
        calls.retain(|c| !c.events.is_closed());
        let (continued, calls): (Vec<Call>, Vec<Call>) = calls
            .into_iter()
            .partition(|c| c.episode.as_deref().is_some_and(|e| self.kept.holds(e)));
        for c in continued {
            self.start(rows, c)?;
        }
        if calls.len() > 1 {
            let reqs: Vec<Request> = calls
                .iter()
                .map(|c| Request {
                    id: rows.new_request(),
                    prompt: c.prompt.clone(),
                    n: c.n,
                    params: c.params.clone(),
                })
                .collect();
            let watches: Vec<Watch> = calls.iter().map(|c| self.watch(c)).collect();
            let admitted =
                rows.prefill(|g, model, v| g.admit_all_watched(model, v, &reqs, &watches));
            if let Ok(Ok(())) = admitted {
                let prefilled = calls.iter().filter(|c| c.episode.is_some()).count();
                if prefilled > 0 {
                    crate::metrics::episode_cache("prefilled", prefilled as u64);
                }
                for (call, req) in calls.into_iter().zip(&reqs) {
                    self.serve(req.id, call);
                }
                return Ok(());
            }
        }
        for c in calls {
            self.start(rows, c)?;
        }
        Ok(())
    }

    fn owns(&self, request: u64) -> bool {
        self.calls.contains_key(&request)
    }

    /// Hands the call its token; ends the row when its text reached a stop string.
    fn drawn(&mut self, rows: &mut Rows<'_>, d: Drawn) {
        let Some(text) = self
            .calls
            .get_mut(&d.request_id)
            .and_then(|call| call.texts.get_mut(d.index).map(|t| (t, &call.events)))
        else {
            return;
        };
        let (text, events) = text;
        if text.stopped() {
            return;
        }
        let piece = text.push(&self.tokenizer, d.token).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "a served token has no text");
            String::new()
        });
        let _ = events.send(CallEvent::Token {
            index: d.index,
            token: d.token,
            logprob: d.logprob,
            version: d.version,
            text: piece,
            alternatives: d.alternatives,
        });
        if text.stopped()
            && let Some(c) = rows
                .generator()
                .finish_row(d.request_id, d.index, FinishReason::Stop)
        {
            rows.count(&c);
            self.finished(rows, c);
        }
    }

    /// Hands the call one of its finished rows (its text up to a stop string).
    fn finished(&mut self, rows: &mut Rows<'_>, c: Completion) {
        let kept = rows.generator().take_kept(c.request_id);
        let Some(call) = self.calls.get_mut(&c.request_id) else {
            return;
        };
        if let (Some(kept), Some(episode)) = (kept, &call.episode) {
            self.kept.insert(episode.clone(), kept);
        }
        let Some(text) = call.texts.get_mut(c.index) else {
            return;
        };
        let finish = if text.stopped() {
            FinishReason::Stop
        } else {
            c.finish
        };
        let rest = text.finish(&self.tokenizer).unwrap_or_default();
        let id = c.request_id;
        let _ = call.events.send(CallEvent::Finished {
            index: c.index,
            finish,
            completion: Box::new(c),
            text: rest,
        });
        call.open = call.open.saturating_sub(1);
        if call.open == 0 {
            self.calls.remove(&id);
        }
    }

    fn panicked(&mut self, request: u64, how: &Panicked<'_>) {
        if let Some(call) = self.calls.remove(&request) {
            let _ = call.events.send(CallEvent::Failed(format!(
                "a forward pass over this call's rows panicked: {}",
                how.message
            )));
        }
    }

    /// Reports the rows the calls hold when that changed.
    fn after_pass(&mut self) {
        let rows: usize = self.calls.values().map(|c| c.open).sum();
        if rows != self.served_rows {
            self.served_rows = rows;
            crate::metrics::serving_rows(rows);
        }
    }
}
