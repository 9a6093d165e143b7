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
pub mod listen;
pub mod recorded;
mod server;
mod stream;

use super::decode::calls::{Call, CallEvent, CallMessage, CallSender};
use crate::stages::StageError;
use api::{ApiError, Endpoint};
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use episodes::AgentEpisodes;
use serde_json::json;
pub use server::{EPISODE_HEADER, GROUP_HEADER, KEY_ENV, Setup};
use server::{Gathered, Server, Timer, stopped};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;
use stream::Streamed;
use tokio::sync::Semaphore;
use tokio::sync::mpsc::unbounded_channel;

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
    let limits = setup.limits;
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
            _ = listen::accept(listener, app, limits) => {}
            _ = sweep => {}
        }
    });
    Ok((bound, task))
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

async fn completions(State(s): State<Arc<Server>>, headers: HeaderMap, body: Body) -> Response {
    serve(s, Endpoint::Completions, headers, body).await
}

async fn chat(State(s): State<Arc<Server>>, headers: HeaderMap, body: Body) -> Response {
    serve(s, Endpoint::Chat, headers, body).await
}

/// One call, start to end (or to its first event when streamed). The body is read once
/// the key is checked, before the call takes one of the requests admitted at once.
async fn serve(s: Arc<Server>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let mut timer = Timer::new(endpoint.as_str());
    let refuse = |timer: &mut Timer, e: ApiError| {
        timer.outcome = Some(e.outcome());
        e.into_response()
    };
    let body = match s.authorized_body(&headers, body).await {
        Ok(b) => b,
        Err(e) => return refuse(&mut timer, e),
    };
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
        alternatives: p.sampling.top_logprobs,
        episode: p.episode.as_ref().map(|l| l.id.clone()),
        events: tx,
    };
    if s.calls.send(CallMessage::Call(call)).is_err() {
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
