//! A streamed call's server-sent events: each event from the decode thread becomes chunks in
//! OpenAI's format, then the usage and recorded-call chunk, then `[DONE]`.

use super::api::{self, ApiError, ChoiceTokens, Endpoint, Head};
use super::recorded::finish_reason;
use super::server::{Gathered, Prepared, Server, Timer, stopped};
use crate::stages::generator::decode::calls::CallEvent;
use axum::response::sse::Event;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

/// A streamed call: each decoder event becomes chunks, then `[DONE]`.
pub(super) struct Streamed {
    pub(super) server: Arc<Server>,
    pub(super) head: Head,
    pub(super) prepared: Prepared,
    pub(super) rx: UnboundedReceiver<CallEvent>,
    pub(super) gathered: Gathered,
    /// Whether each choice has had its first chunk (which carries the prompt's ids).
    pub(super) sent: Vec<bool>,
    pub(super) queue: VecDeque<Event>,
    pub(super) done: bool,
    pub(super) timer: Timer,
    pub(super) _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Streamed {
    fn chunk(
        &mut self,
        index: usize,
        text: &str,
        tokens: ChoiceTokens,
        finish: Option<&str>,
    ) -> Event {
        let p = &self.prepared;
        if self.sent.len() <= index {
            self.sent.resize(index + 1, false);
        }
        let first = !std::mem::replace(&mut self.sent[index], true);
        let logprobs = (p.sampling.logprobs && !tokens.token_ids.is_empty()).then(|| {
            let texts = |ids: &[u32]| self.server.token_texts(ids);
            let offset = self
                .gathered
                .choices
                .get(index)
                .map_or(0, |c| c.text.len() - text.len());
            let listed = p.sampling.top_logprobs > 0;
            api::logprobs_json(p.endpoint, &tokens, &texts, offset, listed)
        });
        let mut choice = json!({
            "index": index,
            "logprobs": logprobs,
            "finish_reason": finish,
            "rlstream": tokens.json(first.then_some(p.prompt.as_slice())),
        });
        match p.endpoint {
            Endpoint::Completions => choice["text"] = json!(text),
            Endpoint::Chat if first => {
                choice["delta"] = json!({"role": "assistant", "content": text});
            }
            Endpoint::Chat => choice["delta"] = json!({"content": text}),
        }
        data(&self.head.wrap(true, vec![choice], None))
    }

    /// Files an event and queues its chunks.
    pub(super) fn file(&mut self, ev: CallEvent) -> Result<(), ApiError> {
        let (index, text, tokens, finish) = match &ev {
            CallEvent::Token {
                index,
                token,
                logprob,
                version,
                text,
                alternatives,
            } => {
                let mut t = ChoiceTokens::default();
                t.push(*token, *logprob, *version, alternatives.clone());
                (*index, text.clone(), t, None)
            }
            CallEvent::Finished {
                index,
                finish,
                text,
                ..
            } => (
                *index,
                text.clone(),
                ChoiceTokens::default(),
                Some(finish_reason(*finish)),
            ),
            _ => (0, String::new(), ChoiceTokens::default(), None),
        };
        self.gathered.file(ev)?;
        let chunk = self.chunk(index, &text, tokens, finish);
        self.queue.push_back(chunk);
        if self.gathered.open == 0 {
            self.end();
        }
        Ok(())
    }

    /// Queues the last chunks of a call whose every choice ended, and records it: a chunk
    /// without choices carries the usage (when asked for) and the recorded call's place.
    fn end(&mut self) {
        let p = &self.prepared;
        let usage = p.sampling.include_usage.then(|| {
            let completion: usize = self
                .gathered
                .choices
                .iter()
                .map(|c| c.tokens.token_ids.len())
                .sum();
            api::usage(p.prompt.len(), completion)
        });
        let recorded = self.server.record(&mut self.prepared, &mut self.gathered);
        if usage.is_some() || recorded.is_some() {
            let mut last = self.head.wrap(true, Vec::new(), usage);
            if let Some(call) = recorded {
                let episode = self.prepared.episode.as_ref().map(|l| l.id.clone());
                last["rlstream"] = json!({"episode": episode, "call": call});
            }
            self.queue.push_back(data(&last));
        }
        self.queue.push_back(Event::default().data("[DONE]"));
        self.done = true;
        self.timer.outcome = Some("ok");
    }

    /// Ends the stream with `e`'s error body.
    pub(super) fn fail(&mut self, e: ApiError) {
        self.timer.outcome = Some(e.outcome());
        self.queue.push_back(data(&e.body()));
        self.done = true;
    }

    /// The next server-sent event, `None` at the end.
    pub(super) async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.queue.pop_front() {
                return Some(e);
            }
            if self.done {
                return None;
            }
            match self.rx.recv().await {
                Some(ev) => {
                    if let Err(e) = self.file(ev) {
                        self.fail(e);
                    }
                }
                None => self.fail(stopped()),
            }
        }
    }
}

/// A server-sent event carrying `v`.
fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}
