//! The endpoint's connections and request bodies, bounded against clients that would hold
//! them: at most `gen.serve_max_connections` open at once (one past it is closed as soon as
//! it is accepted), `gen.serve_read_timeout_s` to send a request's headers (hyper's header
//! read timeout, which also runs while a keep-alive connection waits for its next request,
//! so an idle connection is closed after it) and as long again for its body, and bodies of
//! at most `gen.serve_max_body_bytes` (413 with an OpenAI error body, unread when the
//! declared length already says so).

use super::api::ApiError;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How much a client may hold of the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// Largest request body read.
    pub max_body: usize,
    /// Time to send a request's headers, then its body; an idle keep-alive connection is
    /// closed after it.
    pub read_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

/// Accepts connections on `listener` and serves `app` on each (HTTP/1.1) within `limits`,
/// until the task is aborted.
pub(super) async fn accept(listener: TcpListener, app: Router, limits: ClientLimits) {
    let open = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, most likely: the connections open now end in time.
                tracing::warn!(error = %e, "the endpoint cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            crate::metrics::connection_refused();
            drop(stream);
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.read_timeout)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, "an endpoint connection ended");
            }
            drop(permit);
        });
    }
}

/// The body of a request with `headers`, read within `limits`: 413 past the largest body
/// (before reading, when `Content-Length` says so), 408 when it does not arrive in time.
pub(super) async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limits: &ClientLimits,
) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!(
                "the request body is larger than this endpoint reads ({} bytes, gen.serve_max_body_bytes)",
                limits.max_body
            ),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body as u64) {
        return Err(too_large());
    }
    match tokio::time::timeout(
        limits.read_timeout,
        axum::body::to_bytes(body, limits.max_body),
    )
    .await
    {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) if is_length_limit(&e) => Err(too_large()),
        Ok(Err(e)) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            format!("the request body could not be read: {e}"),
        )),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!(
                "the request body did not arrive within {} s (gen.serve_read_timeout_s)",
                limits.read_timeout.as_secs_f64()
            ),
        )),
    }
}

/// Whether reading a body failed on its length limit.
fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}
