//! The endpoint's state: what it knows of the generator ([`Setup`]), the calls it has let in,
//! and how a request becomes a call to the decode thread and its answer a response body.

use super::super::config::capped_top_k;
use super::super::decode::calls::{CallEvent, CallSender};
use super::api::{ApiError, Body, CallSampling, ChoiceTokens, Endpoint, Head, Input};
use super::episodes::{AgentEpisodes, Extension, Given, Kind, Start};
use super::recorded::{RecordedCall, finish_reason};
use crate::bus::{SharedBus, Topology};
use crate::model::chat::ChatTemplate;
use crate::model::sampler::Completion;
use crate::model::tokenizer::Tokenizer;
use crate::schema::SamplingParams;
use axum::http::{HeaderMap, StatusCode};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio::sync::mpsc::UnboundedReceiver;

/// The header that names a call's episode.
pub const EPISODE_HEADER: &str = "x-rlstream-episode";

/// The header that names an episode's group (its first call; trained episodes only).
pub const GROUP_HEADER: &str = "x-rlstream-group";

/// The environment variable holding the bearer key (when no key file is given).
pub const KEY_ENV: &str = "RLSTREAM_SERVE_KEY";

/// What the endpoint needs to know about the generator.
pub struct Setup {
    pub addr: SocketAddr,
    pub key: Option<String>,
    /// The model's id in requests and `/v1/models`.
    pub model_id: String,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub vocab: usize,
    pub context: usize,
    pub stop_tokens: Vec<u32>,
    /// The policy's temperature (the default, and the only one a recorded call may use).
    pub temperature: f32,
    pub mask_cap: u32,
    pub max_batch: usize,
    pub max_requests: usize,
    pub seed: u64,
    pub episode_ttl: Duration,
    /// Episodes per group (`--group-size`), and how long a group may stay open.
    pub group_size: usize,
    pub group_timeout: Duration,
    /// Where closed groups are published (rollouts) or dead-lettered.
    pub bus: SharedBus,
    pub topo: Topology,
    /// The generator's name (`gen_id` of the groups it publishes).
    pub gen_id: String,
    /// What a client may hold of the endpoint: connections, read time, body size.
    pub limits: super::listen::ClientLimits,
}

pub(super) struct Server {
    pub(super) setup: Setup,
    pub(super) calls: CallSender,
    pub(super) permits: Arc<Semaphore>,
    pub(super) episodes: Arc<AgentEpisodes>,
    /// Requests so far (response ids, and the seeds of requests that give none).
    pub(super) requests: AtomicU64,
    pub(super) started: u64,
}

/// Records a request's outcome and time when it ends; a request dropped before it ended
/// (its client went away) counts as `disconnected`.
pub(super) struct Timer {
    pub(super) endpoint: &'static str,
    pub(super) start: Instant,
    pub(super) outcome: Option<&'static str>,
}

impl Timer {
    pub(super) fn new(endpoint: &'static str) -> Self {
        Timer {
            endpoint,
            start: Instant::now(),
            outcome: None,
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or("disconnected");
        crate::metrics::serve_request(self.endpoint, outcome, self.start.elapsed().as_secs_f64());
    }
}

/// Compares in time that does not depend on where the strings differ.
pub(super) fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Server {
    pub(super) fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.setup.key else {
            return Ok(());
        };
        let given = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(g) if same_key(g.trim().as_bytes(), key.as_bytes()) => Ok(()),
            _ => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
                "missing or wrong bearer key (Authorization: Bearer KEY)",
            )),
        }
    }

    /// The body of a request with `headers`, once its key is checked, read within the
    /// endpoint's limits ([`super::listen::read_body`]).
    pub(super) async fn authorized_body(
        &self,
        headers: &HeaderMap,
        body: axum::body::Body,
    ) -> Result<axum::body::Bytes, ApiError> {
        self.authorize(headers)?;
        super::listen::read_body(headers, body, &self.setup.limits).await
    }

    /// Reads, checks and tokenizes a request: the call to decode, or why not.
    pub(super) fn prepare(
        &self,
        endpoint: Endpoint,
        headers: &HeaderMap,
        bytes: &[u8],
    ) -> Result<Prepared, ApiError> {
        let mut body = Body::parse(bytes)?;
        let model: String = body
            .take("model")?
            .ok_or_else(|| ApiError::param("invalid_value", "model", "`model` is required"))?;
        if model != self.setup.model_id {
            return Err(ApiError {
                param: Some("model".into()),
                ..ApiError::new(
                    StatusCode::NOT_FOUND,
                    "model_not_found",
                    format!(
                        "no model `{model}` here: this generator serves `{}`",
                        self.setup.model_id
                    ),
                )
            });
        }
        let input = match endpoint {
            Endpoint::Completions => super::api::completion_input(&mut body)?,
            Endpoint::Chat => super::api::chat_input(&mut body)?,
        };
        let mut sampling = CallSampling::take(&mut body, self.setup.max_batch)?;
        (sampling.logprobs, sampling.top_logprobs) = alternatives(endpoint, &mut body)?;
        body.finish()?;
        let episode = header_id(headers, EPISODE_HEADER)?;
        let group = header_id(headers, GROUP_HEADER)?;
        if group.is_some() && episode.is_none() {
            return Err(ApiError::param(
                "invalid_value",
                GROUP_HEADER,
                format!("{GROUP_HEADER} names the group of an episode: give {EPISODE_HEADER} too"),
            ));
        }
        let (prompt, given) = self.tokenize(input)?;
        let number = self.requests.fetch_add(1, Ordering::Relaxed);
        let recorded = episode.is_some();
        let params = self.params(endpoint, &sampling, prompt.len(), recorded, number)?;
        let mut p = Prepared {
            number,
            endpoint,
            prompt,
            sampling,
            params,
            episode: None,
            given,
            extension: Extension::Untracked,
        };
        if let Some(id) = episode {
            self.start_episode(&mut p, id, group.as_deref())?;
        }
        Ok(p)
    }

    /// Starts `p` as a call of episode `id` (in `group`): decoded from the episode's ids
    /// when it extends them. The episode is busy until the call is recorded or `p` dropped.
    pub(super) fn start_episode(
        &self,
        p: &mut Prepared,
        id: String,
        group: Option<&str>,
    ) -> Result<(), ApiError> {
        let tokenizer = &self.setup.tokenizer;
        let start = Start {
            episode: &id,
            group,
            n: p.sampling.n,
            given: &p.given,
            prompt: &p.prompt,
            sampling: &p.params,
        };
        let extension = self
            .episodes
            .start(&start, |t: &str| {
                tokenizer.encode(t).map_err(|e| e.to_string())
            })
            .map_err(ApiError::from)?;
        p.episode = Some(Lease {
            episodes: self.episodes.clone(),
            id,
            open: true,
        });
        if let Extension::Extends { ids, .. } = &extension {
            let room = self.setup.context.saturating_sub(ids.len());
            if room < p.params.max_new_tokens as usize {
                return Err(ApiError::param(
                    "context_length_exceeded",
                    "messages",
                    format!(
                        "the episode so far ({} tokens) and max_tokens ({}) exceed the model's context of {} tokens",
                        ids.len(),
                        p.params.max_new_tokens,
                        self.setup.context
                    ),
                ));
            }
            p.prompt = ids.clone();
        }
        p.extension = extension;
        Ok(())
    }

    /// The ids of `input`, and the prompt as given (what a later call of its episode must
    /// extend).
    pub(super) fn tokenize(&self, input: Input) -> Result<(Vec<u32>, Given), ApiError> {
        let tokenizer_error =
            |e: crate::model::ModelError| ApiError::param("invalid_value", "prompt", e.to_string());
        Ok(match input {
            Input::Text(t) => (
                self.setup.tokenizer.encode(&t).map_err(tokenizer_error)?,
                Given::Text(Kind::Text, t),
            ),
            Input::Ids(ids) => {
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.setup.vocab) {
                    return Err(ApiError::param(
                        "invalid_value",
                        "prompt",
                        format!(
                            "token id {bad} is past the model's {}-id vocabulary",
                            self.setup.vocab
                        ),
                    ));
                }
                (ids.clone(), Given::Ids(ids))
            }
            Input::Chat { messages, kwargs } => {
                let Some(template) = &self.setup.template else {
                    return Err(ApiError::param(
                        "invalid_value",
                        "messages",
                        "this model has no chat template: use /v1/completions",
                    ));
                };
                let text = template
                    .render(&messages, true, &kwargs)
                    .map_err(|e| ApiError::param("invalid_value", "messages", e.to_string()))?;
                let ids = self
                    .setup
                    .tokenizer
                    .encode(&text)
                    .map_err(tokenizer_error)?;
                (ids, Given::Text(Kind::Chat, text))
            }
        })
    }

    /// How to sample a prompt of `prompt_len` tokens as `s` asks (request `number` seeds
    /// a call that gives no seed). Without `max_tokens`, a
    /// completion may take 16 tokens (OpenAI's default) and a chat reply what the context
    /// leaves.
    pub(super) fn params(
        &self,
        endpoint: Endpoint,
        s: &CallSampling,
        prompt_len: usize,
        recorded: bool,
        number: u64,
    ) -> Result<SamplingParams, ApiError> {
        let context = self.setup.context;
        let room = context.saturating_sub(prompt_len.max(1));
        if room == 0 {
            return Err(ApiError::param(
                "context_length_exceeded",
                "messages",
                format!(
                    "the prompt is {prompt_len} tokens; the model's context is {context}, leaving no room for a completion"
                ),
            ));
        }
        let max_tokens = match s.max_tokens {
            Some(m) if m as usize > room => {
                return Err(ApiError::param(
                    "context_length_exceeded",
                    "max_tokens",
                    format!(
                        "the prompt ({prompt_len} tokens) and max_tokens ({m}) exceed the model's context of {context} tokens"
                    ),
                ));
            }
            Some(m) => m,
            None => match endpoint {
                Endpoint::Completions => room.min(16) as u32,
                Endpoint::Chat => room as u32,
            },
        };
        let policy = self.setup.temperature;
        let temperature = s.temperature.unwrap_or(policy);
        if recorded && (temperature - policy).abs() > 1e-6 {
            return Err(ApiError::param(
                "not_trainable",
                "temperature",
                format!(
                    "a recorded call ({EPISODE_HEADER}) samples at the policy's temperature {policy}, which the trainer's log-probs assume: leave `temperature` out or set it to {policy}"
                ),
            ));
        }
        Ok(SamplingParams {
            temperature,
            top_k: capped_top_k(s.top_k, s.top_p, self.setup.mask_cap),
            top_p: s.top_p,
            max_new_tokens: max_tokens,
            stop_tokens: self.setup.stop_tokens.clone(),
            seed: s.seed.unwrap_or_else(|| {
                crate::seed::derive(self.setup.seed, &format!("call-{}-{number}", self.started))
            }),
        })
    }

    pub(super) fn head(&self, endpoint: Endpoint, n: u64) -> Head {
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        Head {
            id: format!("{prefix}-{:x}{n:06x}", self.started),
            created: crate::schema::now_us() / 1_000_000,
            model: self.setup.model_id.clone(),
            endpoint,
        }
    }

    /// Each token's text, for OpenAI's `logprobs`.
    pub(super) fn token_texts(&self, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .map(|&t| self.setup.tokenizer.decode(&[t]).unwrap_or_default())
            .collect()
    }
}

/// Whether a request asks for its tokens' log-probs, and for how many alternatives beside
/// each: completions' `logprobs: N` (0 for the log-probs alone), chat's `logprobs: true`
/// with `top_logprobs: N`; at most [`MAX_ALTERNATIVES`](super::api::MAX_ALTERNATIVES).
fn alternatives(endpoint: Endpoint, body: &mut Body) -> Result<(bool, usize), ApiError> {
    let max = super::api::MAX_ALTERNATIVES;
    let (field, asked, top) = match endpoint {
        Endpoint::Completions => {
            let n: Option<u64> = body.take("logprobs")?;
            ("logprobs", n.is_some(), n.unwrap_or(0))
        }
        Endpoint::Chat => {
            let asked: bool = body.take("logprobs")?.unwrap_or(false);
            let n: Option<u64> = body.take("top_logprobs")?;
            if n.is_some_and(|n| n > 0) && !asked {
                return Err(ApiError::param(
                    "invalid_value",
                    "top_logprobs",
                    "`top_logprobs` lists alternatives beside each token's log-prob: give `logprobs: true` with it",
                ));
            }
            ("top_logprobs", asked, n.unwrap_or(0))
        }
    };
    if top > max as u64 {
        return Err(ApiError::param(
            "invalid_value",
            field,
            format!(
                "at most {max} alternatives are listed beside each token: `{field}` must be 0 to {max}"
            ),
        ));
    }
    Ok((asked, top as usize))
}

/// A request read and checked.
pub(super) struct Prepared {
    /// The request's number since the endpoint started.
    pub(super) number: u64,
    pub(super) given: Given,
    pub(super) extension: Extension,
    pub(super) endpoint: Endpoint,
    pub(super) prompt: Vec<u32>,
    pub(super) sampling: CallSampling,
    pub(super) params: SamplingParams,
    pub(super) episode: Option<Lease>,
}

/// A call's hold on its episode: released (not recorded) when dropped before
/// [`Server::record`], whatever ended the call.
pub(super) struct Lease {
    pub(super) episodes: Arc<AgentEpisodes>,
    pub(super) id: String,
    pub(super) open: bool,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.open {
            self.episodes.release(&self.id);
        }
    }
}

/// The id a request's header `name` gives, if any.
pub(super) fn header_id(
    headers: &HeaderMap,
    name: &'static str,
) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(name) else {
        return Ok(None);
    };
    match v.to_str() {
        Ok(s) if !s.trim().is_empty() && s.len() <= super::episodes::MAX_ID => {
            Ok(Some(s.trim().to_string()))
        }
        _ => Err(ApiError::param(
            "invalid_value",
            name,
            format!(
                "{name} must be 1 to {} visible characters",
                super::episodes::MAX_ID
            ),
        )),
    }
}

/// One choice as it arrives.
#[derive(Default)]
pub(super) struct Choice {
    pub(super) tokens: ChoiceTokens,
    pub(super) text: String,
    pub(super) finish: Option<&'static str>,
    pub(super) completion: Option<Completion>,
}

/// A call's choices as they arrive.
pub(super) struct Gathered {
    pub(super) choices: Vec<Choice>,
    pub(super) open: usize,
}

impl Gathered {
    pub(super) fn new(n: usize) -> Self {
        Gathered {
            choices: (0..n).map(|_| Choice::default()).collect(),
            open: n,
        }
    }

    /// Files `first` and every event after it until each choice has ended.
    pub(super) async fn gather(
        &mut self,
        first: CallEvent,
        rx: &mut UnboundedReceiver<CallEvent>,
    ) -> Result<(), ApiError> {
        self.file(first)?;
        while self.open > 0 {
            self.file(rx.recv().await.ok_or_else(stopped)?)?;
        }
        Ok(())
    }

    /// Files an event: `Err` when the call failed.
    pub(super) fn file(&mut self, ev: CallEvent) -> Result<(), ApiError> {
        match ev {
            CallEvent::Token {
                index,
                token,
                logprob,
                version,
                text,
                alternatives,
            } => {
                if let Some(c) = self.choices.get_mut(index) {
                    c.tokens.push(token, logprob, version, alternatives);
                    c.text.push_str(&text);
                }
            }
            CallEvent::Finished {
                index,
                finish,
                completion,
                text,
            } => {
                if let Some(c) = self.choices.get_mut(index) {
                    c.text.push_str(&text);
                    c.finish = Some(finish_reason(finish));
                    c.completion = Some(*completion);
                    self.open = self.open.saturating_sub(1);
                }
            }
            CallEvent::Refused { reason, detail } => {
                let code = if reason == "context" {
                    "context_length_exceeded"
                } else {
                    "invalid_value"
                };
                return Err(ApiError::param(code, "prompt", detail));
            }
            CallEvent::Failed(detail) => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "generation_failed",
                    detail,
                ));
            }
        }
        Ok(())
    }
}

/// The decode thread stopped before the call ended.
pub(super) fn stopped() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "generator_stopped",
        "the generator stopped before the call ended",
    )
}

impl Server {
    /// Records a finished call when it names an episode (releasing the episode): its
    /// number there.
    pub(super) fn record(&self, p: &mut Prepared, gathered: &mut Gathered) -> Option<usize> {
        let lease = p.episode.as_mut()?;
        lease.open = false;
        // What a later call's prompt must continue with: a chat template renders the
        // completion with its special tokens (the stop token the model sampled); a text
        // prompt holds the text the client got.
        let completion_text = match (p.endpoint, gathered.choices.first()) {
            (Endpoint::Chat, Some(c)) => self
                .setup
                .tokenizer
                .decode_special(&c.tokens.token_ids)
                .unwrap_or_default(),
            (Endpoint::Completions, Some(c)) => c.text.clone(),
            (_, None) => String::new(),
        };
        let choices: Vec<Completion> = gathered
            .choices
            .iter_mut()
            .filter_map(|c| c.completion.take())
            .collect();
        let call = RecordedCall {
            endpoint: p.endpoint.as_str(),
            prompt: p.prompt.clone(),
            sampling: p.params.clone(),
            choices,
        };
        Some(
            self.episodes
                .record(&lease.id, call, &p.extension, &p.given, &completion_text),
        )
    }

    /// The whole (not streamed) response of a finished call.
    pub(super) fn whole(&self, p: &mut Prepared, head: &Head, gathered: &mut Gathered) -> Value {
        let mut completion_tokens = 0;
        let choices: Vec<Value> = gathered
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                completion_tokens += c.tokens.token_ids.len();
                let logprobs = p.sampling.logprobs.then(|| {
                    let texts = |ids: &[u32]| self.token_texts(ids);
                    let listed = p.sampling.top_logprobs > 0;
                    super::api::logprobs_json(p.endpoint, &c.tokens, &texts, 0, listed)
                });
                let mut v = json!({
                    "index": i,
                    "logprobs": logprobs,
                    "finish_reason": c.finish,
                    "rlstream": c.tokens.json(Some(&p.prompt)),
                });
                match p.endpoint {
                    Endpoint::Completions => v["text"] = json!(c.text),
                    Endpoint::Chat => {
                        v["message"] = json!({"role": "assistant", "content": c.text});
                    }
                }
                v
            })
            .collect();
        let usage = super::api::usage(p.prompt.len(), completion_tokens);
        let mut body = head.wrap(false, choices, Some(usage));
        if let Some(call) = self.record(p, gathered) {
            let episode = p.episode.as_ref().map(|l| l.id.clone());
            body["rlstream"] = json!({"episode": episode, "call": call});
        }
        body
    }
}
