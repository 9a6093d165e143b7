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
    #[error(
        "no consumer group `{group}` on stream `{stream}`: create it first, or, if it existed, Redis lost its data (it restarted without persistence, was flushed, or a replica without the last writes was promoted)"
    )]
    NoGroup { stream: String, group: String },
    /// The stream a blocked read waited on was deleted under it (`UNBLOCKED`): Redis was
    /// flushed, or someone deleted the key.
    #[error(
        "stream `{stream}` was deleted while a read waited on it: Redis was flushed or the key deleted"
    )]
    StreamGone { stream: String },
    /// Redis lost a stream's data and the stage was told to stop rather than go on
    /// (`redis_stop_on_data_loss`).
    #[error(
        "Redis lost the data of stream `{stream}` ({detail}): it restarted without persistence, was flushed, or a replica without the last writes was promoted. Stopping, as redis_stop_on_data_loss asks; what was in flight on the stream is gone. Start the stages again to go on (they recreate their groups), and feed the prompts again if the prompts stream was lost"
    )]
    DataLost { stream: String, detail: String },
    #[error(
        "Redis is full (maxmemory reached, policy noeviction) and refused {op} on `{key}`: raise maxmemory, lower the streams' trim budgets, or let the consumers drain the streams"
    )]
    Full {
        op: &'static str,
        key: String,
        /// Of a batch of appends, those Redis took, as (place in the batch, id): a full
        /// Redis can refuse one append and take a later one (memory freed in between), so a
        /// retry sends exactly the ones not here.
        written: Vec<(usize, super::EntryId)>,
    },
    #[error("bus is closed")]
    Closed,
}

impl BusError {
    pub fn retry_hint(&self) -> RetryHint {
        match self {
            BusError::Unreachable { .. } | BusError::Timeout { .. } | BusError::Full { .. } => {
                RetryHint::WithBackoff
            }
            BusError::Redis { source, .. } => {
                if node_lost(source)
                    || matches!(source.code(), Some("LOADING" | "BUSY" | "TRYAGAIN"))
                {
                    RetryHint::WithBackoff
                } else {
                    RetryHint::NoRetry
                }
            }
            _ => RetryHint::NoRetry,
        }
    }

    /// Whether the error says Redis lost a stream or group this consumer was using: its
    /// group is gone, or the stream was deleted under a blocked read.
    pub fn is_data_loss(&self) -> bool {
        matches!(self, BusError::NoGroup { .. } | BusError::StreamGone { .. })
    }

    pub fn is_retryable(&self) -> bool {
        self.retry_hint() == RetryHint::WithBackoff
    }
}

pub type BusResult<T> = Result<T, BusError>;

/// Whether a failure says the node is gone or is no longer the primary (it dropped, refused
/// or timed out the connection, or answers `READONLY`/`MASTERDOWN`): worth a retry, and,
/// through Sentinel, asking which node is the primary now.
pub(crate) fn node_lost(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_timeout()
        || e.is_connection_refusal()
        || matches!(e.code(), Some("READONLY" | "MASTERDOWN"))
}
