//! `RedisBus`: the bus on Redis streams.
//!
//! One shared [`ConnectionManager`] carries every non-blocking command (it reconnects with
//! backoff when Redis goes away). A blocking `XREADGROUP`/`XREAD` holds its connection on
//! the server until it returns, so each blocking reader takes a dedicated connection from a
//! small pool instead, without a response timeout of its own; the call is bounded by its
//! own `BLOCK` time plus [`BLOCK_GRACE`].
//!
//! Each entry carries the message bytes in a single field, [`PAYLOAD_FIELD`].
//!
//! - [`connect`]: the options, TLS files and client a bus opens, and errors naming the URL;
//! - [`reply`]: Redis replies read back into entries and ids;
//! - [`sentinel`]: the primary named through Sentinel (`redis+sentinel://`), followed
//!   through failovers.

mod connect;
mod reply;
mod sentinel;

pub use connect::{RedisOptions, TlsFiles, redact_url};
use connect::{blocking_config, open_client, unreachable};
pub use reply::PAYLOAD_FIELD;
use reply::{
    as_array, as_string, as_u64, bound_arg, fields, parse_entries, parse_id, parse_read_reply,
};

use super::{
    Bus, BusError, BusResult, ConsumerStats, DeadLetterRecord, Entry, EntryId, GroupStart,
    GroupStats, RangeBound, ReadFrom, StreamStats,
};
use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{Client, Cmd, Pipeline, Value};
use sentinel::Sentinels;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// `XREADGROUP` id meaning "entries never delivered to this group".
const NEW_ENTRIES: &str = ">";
/// Extra time a blocking read may take beyond its `BLOCK` before it is abandoned.
pub const BLOCK_GRACE: Duration = Duration::from_secs(5);

pub struct RedisBus {
    url: String,
    /// The connections to the node this bus talks to: replaced when Sentinel names another
    /// primary.
    link: std::sync::RwLock<Arc<Link>>,
    /// The sentinels of a `redis+sentinel://` URL.
    sentinels: Option<Sentinels>,
    opts: RedisOptions,
    /// When the sentinels were last asked (at most every [`FOLLOW_EVERY`]).
    last_asked: Mutex<Option<Instant>>,
}

/// The connections to one Redis node.
struct Link {
    /// `HOST:PORT`, for logs and to tell a new primary from the same one.
    addr: String,
    client: Client,
    shared: ConnectionManager,
    /// Idle dedicated connections for blocking reads.
    blocking_pool: Mutex<Vec<MultiplexedConnection>>,
}

/// Shortest time between two questions to the sentinels.
const FOLLOW_EVERY: Duration = Duration::from_millis(250);

impl Link {
    /// Connects to `client`'s node and checks that it answers; a clear error naming `url`
    /// if it does not.
    async fn open(client: Client, url: &str, opts: &RedisOptions) -> BusResult<Link> {
        // One connection first, without the shared connection's reconnect attempts: a wrong
        // URL, password or certificate fails here at once. It then serves blocking reads.
        let first = client
            .get_multiplexed_async_connection_with_config(&blocking_config(opts.connect_timeout))
            .await
            .map_err(|source| unreachable(url, source))?;
        let mut probe = first.clone();
        match tokio::time::timeout(
            opts.response_timeout,
            redis::cmd("PING").query_async::<String>(&mut probe),
        )
        .await
        {
            Ok(Ok(_)) => {}
            Ok(Err(source)) => return Err(unreachable(url, source)),
            Err(_) => {
                return Err(BusError::Timeout {
                    op: "PING",
                    key: String::new(),
                    timeout_ms: opts.response_timeout.as_millis() as u64,
                });
            }
        }
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(opts.response_timeout))
            .set_connection_timeout(Some(opts.connect_timeout))
            .set_number_of_retries(opts.reconnect_retries)
            .set_max_delay(opts.max_backoff);
        let shared = client
            .get_connection_manager_with_config(config)
            .await
            .map_err(|source| unreachable(url, source))?;
        Ok(Link {
            addr: client.get_connection_info().addr().to_string(),
            client,
            shared,
            blocking_pool: Mutex::new(vec![first]),
        })
    }
}

impl RedisBus {
    /// Connects and checks that Redis answers; a clear error if it does not.
    pub async fn connect(url: &str) -> BusResult<Self> {
        Self::connect_with(url, RedisOptions::default()).await
    }

    /// Connects to the Redis `url` names: a node (`redis://`, `rediss://`), or the primary
    /// the sentinels of a `redis+sentinel://` URL name, followed through failovers.
    pub async fn connect_with(url: &str, opts: RedisOptions) -> BusResult<Self> {
        let redacted = redact_url(url);
        let sentinels = Sentinels::parse(url, &redacted).transpose()?;
        let client = match &sentinels {
            Some(s) => {
                if !opts.tls.is_empty() {
                    return Err(BusError::Tls {
                        url: redacted,
                        reason: "TLS through Sentinel is not supported: give the primary's rediss:// URL".into(),
                    });
                }
                s.primary()
                    .await
                    .map_err(|source| unreachable(url, source))?
            }
            None => open_client(url, &opts.tls)?,
        };
        let link = Link::open(client, url, &opts).await?;
        if let Some(s) = &sentinels {
            tracing::info!(primary = s.name(), addr = %link.addr, "Sentinel names the primary");
        }
        Ok(RedisBus {
            url: redacted,
            link: std::sync::RwLock::new(Arc::new(link)),
            sentinels,
            opts,
            last_asked: Mutex::new(None),
        })
    }

    /// The URL with any password removed, for logs.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn link(&self) -> Arc<Link> {
        match self.link.read() {
            Ok(l) => l.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// After a failure that may mean the primary moved (the node is gone, or answers as a
    /// replica), asks the sentinels which node is the primary and, if another, moves there.
    /// Without sentinels, or when they name the same node, nothing changes: the caller's
    /// error stands and its retry tries again.
    async fn follow(&self, failure: &redis::RedisError) {
        let Some(sentinels) = &self.sentinels else {
            return;
        };
        if !crate::bus::error::node_lost(failure) {
            return;
        }
        {
            let mut last = self.last_asked.lock().await;
            if last.is_some_and(|t| t.elapsed() < FOLLOW_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let client = match sentinels.primary().await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "the sentinels name no primary yet");
                return;
            }
        };
        let addr = client.get_connection_info().addr().to_string();
        let old = self.link();
        if addr == old.addr {
            return;
        }
        match Link::open(client, &self.url, &self.opts).await {
            Ok(link) => {
                tracing::warn!(primary = sentinels.name(), from = %old.addr, to = %addr,
                    "Sentinel promoted another node: following the new primary");
                crate::metrics::error(crate::roles::Stage::Bus, "failover");
                if let Ok(mut l) = self.link.write() {
                    *l = Arc::new(link);
                }
            }
            Err(e) => {
                tracing::debug!(to = %addr, error = %e, "the new primary does not answer yet")
            }
        }
    }

    /// The error of a failed command, after following the primary if it moved.
    async fn failed(&self, op: &'static str, key: &str, source: redis::RedisError) -> BusError {
        self.follow(&source).await;
        redis_err(op, key, source)
    }

    async fn query<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        key: &str,
        cmd: &mut Cmd,
    ) -> BusResult<T> {
        let mut conn = self.link().shared.clone();
        match cmd.query_async(&mut conn).await {
            Ok(v) => Ok(v),
            Err(source) => Err(self.failed(op, key, source).await),
        }
    }

    async fn query_pipe(
        &self,
        op: &'static str,
        key: &str,
        pipe: &Pipeline,
    ) -> BusResult<Vec<Value>> {
        let mut conn = self.link().shared.clone();
        match pipe.query_async(&mut conn).await {
            Ok(v) => Ok(v),
            Err(source) => Err(self.failed(op, key, source).await),
        }
    }

    /// Runs a blocking read on a dedicated connection.
    async fn blocking(
        &self,
        op: &'static str,
        key: &str,
        cmd: &Cmd,
        block: Option<Duration>,
    ) -> BusResult<Value> {
        let link = self.link();
        let pooled = link.blocking_pool.lock().await.pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => match link
                .client
                .get_multiplexed_async_connection_with_config(&blocking_config(
                    self.opts.connect_timeout,
                ))
                .await
            {
                Ok(c) => c,
                Err(source) => return Err(self.failed(op, key, source).await),
            },
        };
        let limit = block.unwrap_or_default() + BLOCK_GRACE;
        match tokio::time::timeout(limit, cmd.query_async::<Value>(&mut conn)).await {
            Ok(Ok(v)) => {
                link.blocking_pool.lock().await.push(conn);
                Ok(v)
            }
            // On any failure the connection's state is unknown: drop it.
            Ok(Err(source)) => Err(self.failed(op, key, source).await),
            Err(_) => Err(BusError::Timeout {
                op,
                key: key.to_string(),
                timeout_ms: limit.as_millis() as u64,
            }),
        }
    }

    /// Delivery counts of this consumer's pending entries in `[first, last]`.
    async fn delivery_counts(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        entries: &mut [Entry],
    ) -> BusResult<()> {
        let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
            return Ok(());
        };
        let reply: Value = self
            .query(
                "XPENDING",
                stream,
                redis::cmd("XPENDING")
                    .arg(stream)
                    .arg(group)
                    .arg(first.id.to_string())
                    .arg(last.id.to_string())
                    .arg(entries.len() * 2 + 16)
                    .arg(consumer),
            )
            .await?;
        let mut counts = HashMap::new();
        for row in as_array(&reply) {
            let row = as_array(row);
            if let (Some(id), Some(n)) =
                (row.first().and_then(parse_id), row.get(3).and_then(as_u64))
            {
                counts.insert(id, n as u32);
            }
        }
        for e in entries.iter_mut() {
            if let Some(&n) = counts.get(&e.id) {
                e.deliveries = n;
            }
        }
        Ok(())
    }

    async fn xinfo_groups(&self, stream: &str) -> BusResult<Vec<GroupStats>> {
        let reply: Value = self
            .query(
                "XINFO GROUPS",
                stream,
                redis::cmd("XINFO").arg("GROUPS").arg(stream),
            )
            .await?;
        let mut groups = Vec::new();
        for g in as_array(&reply) {
            let f = fields(g);
            let name = f.get("name").map(|v| as_string(v)).unwrap_or_default();
            let consumers_reply: Value = self
                .query(
                    "XINFO CONSUMERS",
                    stream,
                    redis::cmd("XINFO").arg("CONSUMERS").arg(stream).arg(&name),
                )
                .await?;
            let consumers = as_array(&consumers_reply)
                .iter()
                .map(|c| {
                    let f = fields(c);
                    ConsumerStats {
                        name: f.get("name").map(|v| as_string(v)).unwrap_or_default(),
                        pending: f.get("pending").and_then(|v| as_u64(v)).unwrap_or(0),
                        idle: Duration::from_millis(
                            f.get("idle").and_then(|v| as_u64(v)).unwrap_or(0),
                        ),
                    }
                })
                .collect();
            groups.push(GroupStats {
                name,
                pending: f.get("pending").and_then(|v| as_u64(v)).unwrap_or(0),
                lag: f.get("lag").and_then(|v| as_u64(v)),
                last_delivered: f
                    .get("last-delivered-id")
                    .and_then(|v| parse_id(v))
                    .unwrap_or_default(),
                consumers,
            });
        }
        Ok(groups)
    }
}

fn redis_err(op: &'static str, key: &str, source: redis::RedisError) -> BusError {
    if source.code() == Some("NOGROUP") {
        let (stream, group) = key.split_once(' ').unwrap_or((key, "?"));
        return BusError::NoGroup {
            stream: stream.to_string(),
            group: group.to_string(),
        };
    }
    if source.code() == Some("UNBLOCKED")
        && source
            .detail()
            .is_some_and(|d| d.contains("no longer exists"))
    {
        let stream = key.split_once(' ').map_or(key, |(s, _)| s);
        return BusError::StreamGone {
            stream: stream.to_string(),
        };
    }
    // A transaction Redis aborted because a queued write was refused for memory is full too.
    let full = source.code() == Some("OOM")
        || source
            .clone()
            .into_server_errors()
            .is_some_and(|errs| errs.iter().any(|(_, e)| e.code() == "OOM"));
    if full {
        return BusError::Full {
            op,
            key: key.to_string(),
            written: Vec::new(),
        };
    }
    BusError::Redis {
        op,
        key: key.to_string(),
        source,
    }
}

#[async_trait]
impl Bus for RedisBus {
    fn backend(&self) -> &'static str {
        "redis"
    }

    async fn create_group(&self, stream: &str, group: &str, start: GroupStart) -> BusResult<()> {
        let id = match start {
            GroupStart::Beginning => "0",
            GroupStart::End => "$",
        };
        let result: BusResult<Value> = self
            .query(
                "XGROUP CREATE",
                stream,
                redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(stream)
                    .arg(group)
                    .arg(id)
                    .arg("MKSTREAM"),
            )
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(BusError::Redis { source, .. }) if source.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn publish(
        &self,
        stream: &str,
        payloads: &[Bytes],
        max_len: Option<u64>,
    ) -> BusResult<Vec<EntryId>> {
        if payloads.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for p in payloads {
            let cmd = pipe.cmd("XADD").arg(stream);
            if let Some(n) = max_len {
                cmd.arg("MAXLEN").arg("~").arg(n);
            }
            cmd.arg("*").arg(PAYLOAD_FIELD).arg(p.as_ref());
        }
        // Each reply on its own: a full Redis may refuse some appends and take others (not
        // only a prefix: memory can be freed between two), and a retry must send exactly
        // the refused ones.
        pipe.ignore_errors();
        let replies = self.query_pipe("XADD", stream, &pipe).await?;
        let mut ids = Vec::with_capacity(replies.len());
        let mut full = None;
        for (i, v) in replies.iter().enumerate() {
            if let Value::ServerError(e) = v {
                match redis_err("XADD", stream, e.clone().into()) {
                    BusError::Full { op, key, .. } => full = Some((op, key)),
                    other => return Err(other),
                }
                continue;
            }
            let id = parse_id(v).ok_or_else(|| BusError::Protocol {
                op: "XADD",
                key: stream.to_string(),
                detail: format!("{v:?} is not an entry id"),
            })?;
            ids.push((i, id));
        }
        match full {
            Some((op, key)) => Err(BusError::Full {
                op,
                key,
                written: ids,
            }),
            None => Ok(ids.into_iter().map(|(_, id)| id).collect()),
        }
    }

    async fn read_group(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        from: ReadFrom,
        count: usize,
        block: Option<Duration>,
    ) -> BusResult<Vec<Entry>> {
        let key = format!("{stream} {group}");
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(group)
            .arg(consumer)
            .arg("COUNT")
            .arg(count.max(1));
        match from {
            ReadFrom::New => {
                if let Some(b) = block {
                    cmd.arg("BLOCK").arg(b.as_millis().max(1) as u64);
                }
                cmd.arg("STREAMS").arg(stream).arg(NEW_ENTRIES);
                let reply = if block.is_some() {
                    self.blocking("XREADGROUP", &key, &cmd, block).await?
                } else {
                    self.query("XREADGROUP", &key, &mut cmd).await?
                };
                Ok(parse_read_reply(&reply, 1))
            }
            ReadFrom::OwnPending { after } => {
                cmd.arg("STREAMS").arg(stream).arg(after.to_string());
                let reply: Value = self.query("XREADGROUP", &key, &mut cmd).await?;
                let mut entries = parse_read_reply(&reply, 1);
                self.delivery_counts(stream, group, consumer, &mut entries)
                    .await?;
                Ok(entries)
            }
        }
    }

    async fn ack(&self, stream: &str, group: &str, ids: &[EntryId]) -> BusResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let mut cmd = redis::cmd("XACK");
        cmd.arg(stream).arg(group);
        for id in ids {
            cmd.arg(id.to_string());
        }
        self.query("XACK", &format!("{stream} {group}"), &mut cmd)
            .await
    }

    async fn touch(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        ids: &[EntryId],
    ) -> BusResult<()> {
        for chunk in ids.chunks(1000) {
            let mut cmd = redis::cmd("XCLAIM");
            cmd.arg(stream).arg(group).arg(consumer).arg(0);
            for id in chunk {
                cmd.arg(id.to_string());
            }
            cmd.arg("JUSTID");
            let _: Value = self
                .query("XCLAIM", &format!("{stream} {group}"), &mut cmd)
                .await?;
        }
        Ok(())
    }

    async fn claim_idle(
        &self,
        stream: &str,
        group: &str,
        consumer: &str,
        min_idle: Duration,
        count: usize,
    ) -> BusResult<Vec<Entry>> {
        let key = format!("{stream} {group}");
        let reply: Value = self
            .query(
                "XAUTOCLAIM",
                &key,
                redis::cmd("XAUTOCLAIM")
                    .arg(stream)
                    .arg(group)
                    .arg(consumer)
                    .arg(min_idle.as_millis() as u64)
                    .arg("0-0")
                    .arg("COUNT")
                    .arg(count.max(1)),
            )
            .await?;
        let mut entries = as_array(&reply)
            .get(1)
            .map(|e| parse_entries(e, 2))
            .unwrap_or_default();
        self.delivery_counts(stream, group, consumer, &mut entries)
            .await?;
        Ok(entries)
    }

    async fn dead_letter(
        &self,
        stream: &str,
        group: &str,
        dead_stream: &str,
        letters: &[DeadLetterRecord],
    ) -> BusResult<()> {
        if letters.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        for l in letters {
            pipe.cmd("XADD")
                .arg(dead_stream)
                .arg("*")
                .arg(PAYLOAD_FIELD)
                .arg(l.letter.as_ref())
                .ignore();
            pipe.cmd("XACK")
                .arg(stream)
                .arg(group)
                .arg(l.entry_id.to_string())
                .ignore();
        }
        self.query_pipe("MULTI XADD+XACK", dead_stream, &pipe)
            .await
            .map(|_| ())
    }

    async fn read_after(
        &self,
        stream: &str,
        after: EntryId,
        count: usize,
        block: Option<Duration>,
    ) -> BusResult<Vec<Entry>> {
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT").arg(count.max(1));
        if let Some(b) = block {
            cmd.arg("BLOCK").arg(b.as_millis().max(1) as u64);
        }
        cmd.arg("STREAMS").arg(stream).arg(after.to_string());
        let reply = if block.is_some() {
            self.blocking("XREAD", stream, &cmd, block).await?
        } else {
            self.query("XREAD", stream, &mut cmd).await?
        };
        Ok(parse_read_reply(&reply, 1))
    }

    async fn range(
        &self,
        stream: &str,
        start: RangeBound,
        end: RangeBound,
        count: usize,
    ) -> BusResult<Vec<Entry>> {
        let reply: Value = self
            .query(
                "XRANGE",
                stream,
                redis::cmd("XRANGE")
                    .arg(stream)
                    .arg(bound_arg(start, "-"))
                    .arg(bound_arg(end, "+"))
                    .arg("COUNT")
                    .arg(count.max(1)),
            )
            .await?;
        Ok(parse_entries(&reply, 1))
    }

    async fn append(&self, stream: &str, entries: &[(EntryId, Bytes)]) -> BusResult<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (id, payload) in entries {
            pipe.cmd("XADD")
                .arg(stream)
                .arg(id.to_string())
                .arg(PAYLOAD_FIELD)
                .arg(payload.as_ref());
        }
        self.query_pipe("XADD", stream, &pipe).await?;
        Ok(())
    }

    async fn memory_usage(&self, stream: &str) -> BusResult<u64> {
        let bytes: Option<u64> = self
            .query(
                "MEMORY USAGE",
                stream,
                redis::cmd("MEMORY")
                    .arg("USAGE")
                    .arg(stream)
                    .arg("SAMPLES")
                    .arg(0),
            )
            .await?;
        Ok(bytes.unwrap_or(0))
    }

    async fn trim_before(&self, stream: &str, min_id: EntryId) -> BusResult<u64> {
        self.query(
            "XTRIM",
            stream,
            redis::cmd("XTRIM")
                .arg(stream)
                .arg("MINID")
                .arg("=")
                .arg(min_id.to_string()),
        )
        .await
    }

    async fn oldest_pending(&self, stream: &str, group: &str) -> BusResult<Option<EntryId>> {
        // Summary form: [count, smallest id, greatest id, [[consumer, count], ...]].
        let reply: Value = self
            .query(
                "XPENDING",
                &format!("{stream} {group}"),
                redis::cmd("XPENDING").arg(stream).arg(group),
            )
            .await?;
        Ok(as_array(&reply).get(1).and_then(parse_id))
    }

    async fn stats(&self, stream: &str) -> BusResult<StreamStats> {
        let reply: BusResult<Value> = self
            .query(
                "XINFO STREAM",
                stream,
                redis::cmd("XINFO").arg("STREAM").arg(stream),
            )
            .await;
        let reply = match reply {
            Ok(v) => v,
            Err(BusError::Redis { source, .. }) if source.code() == Some("ERR") => {
                return Ok(StreamStats::default());
            }
            Err(e) => return Err(e),
        };
        let f = fields(&reply);
        let entry_id = |name: &str| {
            f.get(name)
                .and_then(|e| as_array(e).first())
                .and_then(parse_id)
        };
        Ok(StreamStats {
            length: f.get("length").and_then(|v| as_u64(v)).unwrap_or(0),
            first_id: entry_id("first-entry"),
            last_id: entry_id("last-entry"),
            groups: self.xinfo_groups(stream).await?,
        })
    }

    async fn put_blobs(&self, blobs: &[(String, Bytes)]) -> BusResult<()> {
        if blobs.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (k, v) in blobs {
            pipe.cmd("SET").arg(k).arg(v.as_ref()).ignore();
        }
        self.query_pipe("SET", &blobs[0].0, &pipe).await.map(|_| ())
    }

    async fn get_blobs(&self, keys: &[String]) -> BusResult<Vec<Option<Bytes>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for k in keys {
            pipe.cmd("GET").arg(k);
        }
        let replies = self.query_pipe("GET", &keys[0], &pipe).await?;
        Ok(replies
            .into_iter()
            .map(|v| match v {
                Value::BulkString(b) => Some(Bytes::from(b)),
                _ => None,
            })
            .collect())
    }

    async fn delete(&self, keys: &[String]) -> BusResult<u64> {
        if keys.is_empty() {
            return Ok(0);
        }
        self.query("DEL", &keys[0], redis::cmd("DEL").arg(keys))
            .await
    }
}
