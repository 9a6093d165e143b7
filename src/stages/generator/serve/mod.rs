//! The generator's OpenAI-compatible endpoint (`rlstream gen --serve ADDR`), on axum.
//!
//! - `POST /v1/completions` (a text prompt or token ids) and `POST /v1/chat/completions`
//!   (messages rendered with the model's chat template), each whole or streamed as
//!   server-sent events in OpenAI's chunk format; `GET /v1/models`;
//!   `GET /v1/rlstream/episodes/{id}` returns an episode's recorded calls.
//! - Calls are decoded by the generator's own decode thread, in the batch beside the
//!   stream's prompts and under its weight swaps: each choice carries (in `rlstream`) the
//!   prompt's and the completion's token ids, their behaviour log-probs and the version of
//!   every token.
//! - A request with an `X-Rlstream-Episode: ID` header is recorded under that episode, as
//!   ids ([`episodes`]). It must sample as the trainer assumes: at the policy's temperature
//!   (an omitted temperature is the policy's); any other temperature (0 included) is
//!   refused with 400 `not_trainable`. Top-p and top-k are trainable: the kept sets are
//!   recorded and the trainer renormalises over them (`--mask-cap` applies, as to prompts).
//! - Refusals are OpenAI error bodies with the status: 400 for a body that is not JSON, a
//!   parameter not supported or out of range, a prompt past the context; 404 for another
//!   model; 401 without the bearer key; 429 beyond `--serve-max-requests` requests at once;
//!   503 once the generator stops. A client that goes away mid-stream ends its call: its
//!   rows leave the batch before the next forward pass.
//! - Bound to loopback by default; bound elsewhere it needs a bearer key (from
//!   `--serve-key-file` or `RLSTREAM_SERVE_KEY`, never a flag value that `ps` would show).

pub mod api;
mod close;
pub mod episodes;
pub mod recorded;
mod stream;

use super::config::capped_top_k;
use super::decode::calls::{Call, CallEvent, CallSender};
use crate::bus::{SharedBus, Topology};
use crate::model::chat::ChatTemplate;
use crate::model::sampler::Completion;
use crate::model::tokenizer::Tokenizer;
use crate::schema::SamplingParams;
use crate::stages::StageError;
use api::{ApiError, Body, CallSampling, ChoiceTokens, Endpoint, Head, Input};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use episodes::{AgentEpisodes, Extension, Given, Kind, Start};
use recorded::{RecordedCall, finish_reason};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use stream::Streamed;
use tokio::sync::Semaphore;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

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
}

/// The bearer key: from `file` when given, else from [`KEY_ENV`]; `None` when neither.
pub fn read_key(file: Option<&std::path::Path>) -> Result<Option<String>, StageError> {
    let key = match file {
        Some(f) => Some(std::fs::read_to_string(f).map_err(|e| {
            StageError::Other(format!("cannot read --serve-key-file {}: {e}", f.display()))
        })?),
        None => std::env::var(KEY_ENV).ok(),
    };
    match key.map(|k| k.trim().to_string()) {
        Some(k) if k.is_empty() => Err(StageError::Other(
            "the endpoint's bearer key is empty (--serve-key-file or RLSTREAM_SERVE_KEY)".into(),
        )),
        k => Ok(k),
    }
}

struct Server {
    setup: Setup,
    calls: CallSender,
    permits: Arc<Semaphore>,
    episodes: Arc<AgentEpisodes>,
    /// Requests so far (response ids, and the seeds of requests that give none).
    requests: AtomicU64,
    started: u64,
}

/// Binds `setup.addr` and serves until the returned task is aborted; the address bound.
pub async fn start(
    setup: Setup,
    calls: CallSender,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), StageError> {
    if setup.key.is_none() && !setup.addr.ip().is_loopback() {
        return Err(StageError::Other(format!(
            "gen --serve {} binds beyond loopback: give the endpoint a bearer key with --serve-key-file FILE or {KEY_ENV}",
            setup.addr
        )));
    }
    let listener = tokio::net::TcpListener::bind(setup.addr)
        .await
        .map_err(|e| {
            StageError::Other(format!(
                "cannot serve the endpoint on {}: {e} (is the port taken? pick another --serve)",
                setup.addr
            ))
        })?;
    let bound = listener
        .local_addr()
        .map_err(|e| StageError::Other(format!("the endpoint's socket: {e}")))?;
    let server = Arc::new(Server {
        permits: Arc::new(Semaphore::new(setup.max_requests)),
        episodes: Arc::new(AgentEpisodes::new(
            setup.episode_ttl,
            setup.group_size,
            setup.group_timeout,
            setup.vocab,
            &setup.gen_id,
        )),
        requests: AtomicU64::new(0),
        started: crate::schema::now_us() / 1_000_000,
        setup,
        calls,
    });
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/rlstream/episodes/{episode}", get(episode))
        .route("/v1/rlstream/episodes/{episode}/close", post(close::close))
        .fallback(not_found)
        .with_state(server.clone());
    let sweeper = server;
    tracing::info!(addr = %bound, "serving the OpenAI-compatible endpoint");
    let task = tokio::spawn(async move {
        let sweep = async {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                for dead in sweeper.episodes.expired() {
                    if let Err(e) = sweeper.settle(dead).await {
                        tracing::warn!(error = %e.message, "an expired group was not dead-lettered");
                    }
                }
            }
        };
        tokio::select! {
            served = axum::serve(listener, app) => {
                if let Err(e) = served {
                    tracing::error!(error = %e, "the endpoint stopped");
                }
            }
            _ = sweep => {}
        }
    });
    Ok((bound, task))
}

/// Records a request's outcome and time when it ends; a request dropped before it ended
/// (its client went away) counts as `disconnected`.
struct Timer {
    endpoint: &'static str,
    start: Instant,
    outcome: Option<&'static str>,
}

impl Timer {
    fn new(endpoint: &'static str) -> Self {
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
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Server {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
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

    /// Reads, checks and tokenizes a request: the call to decode, or why not.
    fn prepare(
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
            Endpoint::Completions => api::completion_input(&mut body)?,
            Endpoint::Chat => api::chat_input(&mut body)?,
        };
        let mut sampling = CallSampling::take(&mut body, self.setup.max_batch)?;
        sampling.logprobs = match endpoint {
            Endpoint::Chat => body.take("logprobs")?.unwrap_or(false),
            Endpoint::Completions => match body.take::<u32>("logprobs")? {
                None => false,
                Some(0) => true,
                Some(_) => {
                    return Err(ApiError::param(
                        "unsupported_parameter",
                        "logprobs",
                        "alternatives are not listed: give `logprobs: 0` for the sampled tokens' log-probs (every choice carries them in `rlstream` too)",
                    ));
                }
            },
        };
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
    fn start_episode(
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
    fn tokenize(&self, input: Input) -> Result<(Vec<u32>, Given), ApiError> {
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
    fn params(
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

    fn head(&self, endpoint: Endpoint, n: u64) -> Head {
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
    fn token_texts(&self, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .map(|&t| self.setup.tokenizer.decode(&[t]).unwrap_or_default())
            .collect()
    }
}

/// A request read and checked.
struct Prepared {
    /// The request's number since the endpoint started.
    number: u64,
    given: Given,
    extension: Extension,
    endpoint: Endpoint,
    prompt: Vec<u32>,
    sampling: CallSampling,
    params: SamplingParams,
    episode: Option<Lease>,
}

/// A call's hold on its episode: released (not recorded) when dropped before
/// [`Server::record`], whatever ended the call.
struct Lease {
    episodes: Arc<AgentEpisodes>,
    id: String,
    open: bool,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.open {
            self.episodes.release(&self.id);
        }
    }
}

/// The id a request's header `name` gives, if any.
fn header_id(headers: &HeaderMap, name: &'static str) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(name) else {
        return Ok(None);
    };
    match v.to_str() {
        Ok(s) if !s.trim().is_empty() && s.len() <= episodes::MAX_ID => {
            Ok(Some(s.trim().to_string()))
        }
        _ => Err(ApiError::param(
            "invalid_value",
            name,
            format!(
                "{name} must be 1 to {} visible characters",
                episodes::MAX_ID
            ),
        )),
    }
}

/// One choice as it arrives.
#[derive(Default)]
struct Choice {
    tokens: ChoiceTokens,
    text: String,
    finish: Option<&'static str>,
    completion: Option<Completion>,
}

/// A call's choices as they arrive.
struct Gathered {
    choices: Vec<Choice>,
    open: usize,
}

impl Gathered {
    fn new(n: usize) -> Self {
        Gathered {
            choices: (0..n).map(|_| Choice::default()).collect(),
            open: n,
        }
    }

    /// Files `first` and every event after it until each choice has ended.
    async fn gather(
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
    fn file(&mut self, ev: CallEvent) -> Result<(), ApiError> {
        match ev {
            CallEvent::Token {
                index,
                token,
                logprob,
                version,
                text,
            } => {
                if let Some(c) = self.choices.get_mut(index) {
                    c.tokens.push(token, logprob, version);
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
fn stopped() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "generator_stopped",
        "the generator stopped before the call ended",
    )
}

async fn models(State(s): State<Arc<Server>>, headers: HeaderMap) -> Response {
    if let Err(e) = s.authorize(&headers) {
        return e.into_response();
    }
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": s.setup.model_id,
            "object": "model",
            "created": s.started,
            "owned_by": "rlstream",
            "max_model_len": s.setup.context,
        }],
    }))
    .into_response()
}

async fn episode(
    State(s): State<Arc<Server>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(e) = s.authorize(&headers) {
        return e.into_response();
    }
    match s.episodes.json(&id) {
        Some(v) => axum::Json(v).into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            "episode_not_found",
            format!("no calls are recorded under episode `{id}`"),
        )
        .into_response(),
    }
}

async fn not_found() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such route: /v1/completions, /v1/chat/completions, /v1/models, /v1/rlstream/episodes/{id}",
    )
    .into_response()
}

async fn completions(State(s): State<Arc<Server>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(s, Endpoint::Completions, headers, body).await
}

async fn chat(State(s): State<Arc<Server>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(s, Endpoint::Chat, headers, body).await
}

/// One call, start to end (or to its first event when streamed).
async fn serve(s: Arc<Server>, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
    let mut timer = Timer::new(endpoint.as_str());
    let refuse = |timer: &mut Timer, e: ApiError| {
        timer.outcome = Some(e.outcome());
        e.into_response()
    };
    if let Err(e) = s.authorize(&headers) {
        return refuse(&mut timer, e);
    }
    let Ok(permit) = s.permits.clone().try_acquire_owned() else {
        let e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_requests",
            format!(
                "this generator takes {} requests at once (--serve-max-requests): retry later",
                s.setup.max_requests
            ),
        );
        return refuse(&mut timer, e);
    };
    let mut p = match s.prepare(endpoint, &headers, &body) {
        Ok(p) => p,
        Err(e) => return refuse(&mut timer, e),
    };
    let (tx, mut rx) = unbounded_channel();
    let call = Call {
        prompt: p.prompt.clone(),
        n: p.sampling.n,
        params: p.params.clone(),
        stop: p.sampling.stop.clone(),
        events: tx,
    };
    if s.calls.send(call).is_err() {
        return refuse(&mut timer, stopped());
    }
    let mut gathered = Gathered::new(p.sampling.n);
    // The first event says whether the model took the prompt: a refusal is a 400 even
    // for a streamed call.
    let first = match rx.recv().await {
        Some(ev @ (CallEvent::Refused { .. } | CallEvent::Failed(_))) => {
            let e = gathered.file(ev).err().unwrap_or_else(stopped);
            return refuse(&mut timer, e);
        }
        Some(ev) => ev,
        None => return refuse(&mut timer, stopped()),
    };
    let head = s.head(endpoint, p.number);
    if p.sampling.stream {
        let mut stream = Streamed {
            server: s,
            head,
            prepared: p,
            rx,
            gathered,
            sent: Vec::new(),
            queue: std::collections::VecDeque::new(),
            done: false,
            timer,
            _permit: permit,
        };
        if let Err(e) = stream.file(first) {
            // A token or an end cannot be refused; should it be, the stream says so.
            stream.fail(e);
        }
        let events = futures_util::stream::unfold(stream, |mut st| async move {
            st.next().await.map(|e| (Ok::<Event, Infallible>(e), st))
        });
        return Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    if let Err(e) = gathered.gather(first, &mut rx).await {
        return refuse(&mut timer, e);
    }
    drop(permit);
    let body = s.whole(&mut p, &head, &mut gathered);
    timer.outcome = Some("ok");
    axum::Json(body).into_response()
}

impl Server {
    /// Records a finished call when it names an episode (releasing the episode): its
    /// number there.
    fn record(&self, p: &mut Prepared, gathered: &mut Gathered) -> Option<usize> {
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
    fn whole(&self, p: &mut Prepared, head: &Head, gathered: &mut Gathered) -> Value {
        let mut completion_tokens = 0;
        let choices: Vec<Value> = gathered
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                completion_tokens += c.tokens.token_ids.len();
                let logprobs = p.sampling.logprobs.then(|| {
                    let texts = self.token_texts(&c.tokens.token_ids);
                    api::logprobs_json(p.endpoint, &c.tokens, &texts, 0)
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
        let usage = api::usage(p.prompt.len(), completion_tokens);
        let mut body = head.wrap(false, choices, Some(usage));
        if let Some(call) = self.record(p, gathered) {
            let episode = p.episode.as_ref().map(|l| l.id.clone());
            body["rlstream"] = json!({"episode": episode, "call": call});
        }
        body
    }
}
