//! `BusError`: what can go wrong talking to a stream backend, and whether to retry.

/// Whether an operation that failed is worth trying again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryHint {
    /// The same call will fail the same way (bad arguments, bad config, a bug).
    NoRetry,
    /// The backend is unreachable or busy: retry with backoff.
    WithBackoff,
}

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error(
        "cannot reach Redis at {url}: {source}. Is redis-server running there? (start one with `redis-server`, or pass --redis URL; rediss:// if it speaks TLS)"
    )]
    Unreachable {
        url: String,
        #[source]
        source: redis::RedisError,
    },
    #[error(
        "Redis at {url} refused the credentials: {source}. Give them in the URL: redis://USER:PASSWORD@HOST:PORT for an ACL user, redis://:PASSWORD@HOST:PORT for requirepass"
    )]
    Auth {
        url: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("TLS to Redis at {url}: {reason}")]
    Tls { url: String, reason: String },
    #[error("bad Redis URL `{url}`: {source}")]
    BadUrl {
        url: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("Redis {op} on `{key}` failed: {source}")]
    Redis {
        op: &'static str,
        key: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("Redis {op} on `{key}` timed out after {timeout_ms} ms")]
    Timeout {
        op: &'static str,
        key: String,
        timeout_ms: u64,
    },
    #[error("unexpected reply to {op} on `{key}`: {detail}")]
    Protocol {
        op: &'static str,
        key: String,
        detail: String,
    },
    #[error("no consumer group `{group}` on stream `{stream}` (create it first)")]
    NoGroup { stream: String, group: String },
    #[error("bus is closed")]
    Closed,
}

impl BusError {
    pub fn retry_hint(&self) -> RetryHint {
        match self {
            BusError::Unreachable { .. } | BusError::Timeout { .. } => RetryHint::WithBackoff,
            BusError::Redis { source, .. } => {
                if source.is_io_error()
                    || source.is_connection_dropped()
                    || source.is_timeout()
                    || source.is_connection_refusal()
                    || matches!(
                        source.code(),
                        Some("LOADING" | "BUSY" | "TRYAGAIN" | "MASTERDOWN")
                    )
                {
                    RetryHint::WithBackoff
                } else {
                    RetryHint::NoRetry
                }
            }
            _ => RetryHint::NoRetry,
        }
    }

    pub fn is_retryable(&self) -> bool {
        self.retry_hint() == RetryHint::WithBackoff
    }
}

pub type BusResult<T> = Result<T, BusError>;
