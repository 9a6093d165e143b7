//! `RedisBus`: the bus on Redis streams.
//!
//! One shared [`ConnectionManager`] carries every non-blocking command (it reconnects with
//! backoff when Redis goes away). A blocking `XREADGROUP`/`XREAD` holds its connection on
//! the server until it returns, so each blocking reader takes a dedicated connection from a
//! small pool instead, without a response timeout of its own; the call is bounded by its
//! own `BLOCK` time plus [`BLOCK_GRACE`].
//!
//! Each entry carries the message bytes in a single field, [`PAYLOAD_FIELD`].

use super::{
    Bus, BusError, BusResult, ConsumerStats, DeadLetterRecord, Entry, EntryId, GroupStart,
    GroupStats, RangeBound, ReadFrom, StreamStats,
};
use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, Cmd, Pipeline, TlsCertificates, Value,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::Mutex;

/// The field of every stream entry that holds the MessagePack bytes.
pub const PAYLOAD_FIELD: &str = "d";
/// `XREADGROUP` id meaning "entries never delivered to this group".
const NEW_ENTRIES: &str = ">";
/// Extra time a blocking read may take beyond its `BLOCK` before it is abandoned.
pub const BLOCK_GRACE: Duration = Duration::from_secs(5);

/// How to talk to Redis.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Response timeout of non-blocking commands. Large enough for a weight chunk SET.
    pub response_timeout: Duration,
    /// Time allowed to open a connection.
    pub connect_timeout: Duration,
    /// Reconnect attempts per failure of the shared connection (exponential backoff).
    pub reconnect_retries: usize,
    /// Longest wait between reconnect attempts.
    pub max_backoff: Duration,
    /// Certificates for a `rediss://` URL.
    pub tls: TlsFiles,
}

/// PEM files for TLS to Redis (`rediss://`). Without `ca`, the server's certificate must
/// chain to a root this machine trusts (the system store, or `SSL_CERT_FILE`); `cert` and
/// `key` together are the client certificate for a server with `tls-auth-clients yes`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA certificate(s) that signed the server's certificate.
    pub ca: Option<PathBuf>,
    /// Client certificate (chain).
    pub cert: Option<PathBuf>,
    /// The client certificate's private key.
    pub key: Option<PathBuf>,
}

impl TlsFiles {
    pub fn is_empty(&self) -> bool {
        self.ca.is_none() && self.cert.is_none() && self.key.is_none()
    }
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            response_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(3),
            reconnect_retries: 4,
            max_backoff: Duration::from_secs(2),
            tls: TlsFiles::default(),
        }
    }
}

pub struct RedisBus {
    url: String,
    client: Client,
    shared: ConnectionManager,
    /// Idle dedicated connections for blocking reads.
    blocking_pool: Mutex<Vec<MultiplexedConnection>>,
    connect_timeout: Duration,
}

impl RedisBus {
    /// Connects and checks that Redis answers; a clear error if it does not.
    pub async fn connect(url: &str) -> BusResult<Self> {
        Self::connect_with(url, RedisOptions::default()).await
    }

    pub async fn connect_with(url: &str, opts: RedisOptions) -> BusResult<Self> {
        let client = open_client(url, &opts.tls)?;
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
        Ok(RedisBus {
            url: redact_url(url),
            client,
            shared,
            blocking_pool: Mutex::new(vec![first]),
            connect_timeout: opts.connect_timeout,
        })
    }

    /// The URL with any password removed, for logs.
    pub fn url(&self) -> &str {
        &self.url
    }

    async fn query<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        key: &str,
        cmd: &mut Cmd,
    ) -> BusResult<T> {
        let mut conn = self.shared.clone();
        cmd.query_async(&mut conn)
            .await
            .map_err(|source| redis_err(op, key, source))
    }

    async fn query_pipe(
        &self,
        op: &'static str,
        key: &str,
        pipe: &Pipeline,
    ) -> BusResult<Vec<Value>> {
        let mut conn = self.shared.clone();
        pipe.query_async(&mut conn)
            .await
            .map_err(|source| redis_err(op, key, source))
    }

    /// Runs a blocking read on a dedicated connection.
    async fn blocking(
        &self,
        op: &'static str,
        key: &str,
        cmd: &Cmd,
        block: Option<Duration>,
    ) -> BusResult<Value> {
        let pooled = self.blocking_pool.lock().await.pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => self
                .client
                .get_multiplexed_async_connection_with_config(&blocking_config(
                    self.connect_timeout,
                ))
                .await
                .map_err(|source| redis_err(op, key, source))?,
        };
        let limit = block.unwrap_or_default() + BLOCK_GRACE;
        match tokio::time::timeout(limit, cmd.query_async::<Value>(&mut conn)).await {
            Ok(Ok(v)) => {
                self.blocking_pool.lock().await.push(conn);
                Ok(v)
            }
            // On any failure the connection's state is unknown: drop it.
            Ok(Err(source)) => Err(redis_err(op, key, source)),
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
    BusError::Redis {
        op,
        key: key.to_string(),
        source,
    }
}

/// A connection for blocking reads: no response timeout of its own (the caller bounds it).
fn blocking_config(connect_timeout: Duration) -> AsyncConnectionConfig {
    AsyncConnectionConfig::new()
        .set_response_timeout(None)
        .set_connection_timeout(Some(connect_timeout))
}

/// The client for `url`: plain for `redis://`, TLS with `tls`'s certificates for `rediss://`.
fn open_client(url: &str, tls: &TlsFiles) -> BusResult<Client> {
    let tls_err = |reason: String| BusError::Tls {
        url: redact_url(url),
        reason,
    };
    let is_tls = url.starts_with("rediss://");
    if !is_tls && !tls.is_empty() {
        return Err(tls_err(
            "TLS certificates were given (--redis-tls-ca/--redis-tls-cert/--redis-tls-key) \
             but the URL is not rediss://; use rediss://HOST:PORT for a TLS port"
                .into(),
        ));
    }
    if is_tls {
        // One crypto provider for every TLS connection of the process. An error means one is
        // installed already, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    if tls.is_empty() {
        return Client::open(url).map_err(|source| BusError::BadUrl {
            url: redact_url(url),
            source,
        });
    }
    let read = |what: &str, path: &Path| {
        std::fs::read(path)
            .map_err(|e| tls_err(format!("cannot read the {what} {}: {e}", path.display())))
    };
    let read_certs = |what: &str, path: &Path| {
        let pem = read(what, path)?;
        if pem_has_certificate(&pem) {
            Ok(pem)
        } else {
            Err(tls_err(format!(
                "the {what} {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                path.display()
            )))
        }
    };
    let root_cert = match &tls.ca {
        Some(path) => Some(read_certs("CA certificate", path)?),
        None => None,
    };
    let client_tls = match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => Some(ClientTlsConfig {
            client_cert: read_certs("client certificate", cert)?,
            client_key: read("client key", key)?,
        }),
        (None, None) => None,
        _ => {
            return Err(tls_err(
                "a client certificate needs its key: give both --redis-tls-cert and --redis-tls-key"
                    .into(),
            ));
        }
    };
    Client::build_with_tls(
        url,
        TlsCertificates {
            client_tls,
            root_cert,
        },
    )
    .map_err(|source| tls_err(source.to_string()))
}

fn pem_has_certificate(pem: &[u8]) -> bool {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem).any(|c| c.is_ok())
}

/// The error for a failed first contact: refused credentials, a failed TLS handshake (with
/// what to do about it), or an unreachable server.
fn unreachable(url: &str, source: redis::RedisError) -> BusError {
    let redacted = redact_url(url);
    if source.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(source.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM"))
    {
        return BusError::Auth {
            url: redacted,
            source,
        };
    }
    if url.starts_with("rediss://") {
        let text = source.to_string();
        let hint = if text.contains("insecure") {
            Some(
                "rlstream always verifies the server's certificate: drop #insecure from the URL and give the server's CA with --redis-tls-ca FILE",
            )
        } else if text.contains("KeyMismatch") || text.contains("keys may not be consistent") {
            Some("check that --redis-tls-key is the private key of --redis-tls-cert")
        } else if text.contains("UnknownIssuer") {
            Some(
                "the server's certificate is not signed by a CA this machine trusts: give that CA with --redis-tls-ca FILE",
            )
        } else if text.contains("not valid for name") || text.contains("NotValidForName") {
            Some(
                "the server's certificate does not name the host in the URL: connect by a name the certificate lists",
            )
        } else if text.contains("CertificateRequired") || text.contains("certificate required") {
            Some(
                "the server asks for a client certificate: give --redis-tls-cert FILE and --redis-tls-key FILE",
            )
        } else if text.contains("InvalidContentType") || text.contains("corrupt message") {
            Some("the server does not speak TLS on that port: use redis:// for a plain port")
        } else if source.is_timeout() {
            // A plain Redis reads a ClientHello as an unfinished command and never answers.
            Some("no TLS handshake answer: if that port is a plain (non-TLS) Redis, use redis://")
        } else if text.contains("certificate") || text.contains("Certificate") {
            Some(
                "the TLS handshake failed on a certificate: check --redis-tls-ca, --redis-tls-cert and --redis-tls-key",
            )
        } else {
            None
        };
        if let Some(hint) = hint {
            return BusError::Tls {
                url: redacted,
                reason: format!("{text}. {hint}"),
            };
        }
    }
    BusError::Unreachable {
        url: redacted,
        source,
    }
}

/// `url` without its password, for logs and errors (`redis://user:***@host:6379`).
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let auth = &url[scheme + 3..at];
            let user = auth.split_once(':').map_or(auth, |(u, _)| u);
            format!("{}{}:***{}", &url[..scheme + 3], user, &url[at..])
        }
        _ => url.to_string(),
    }
}

fn bound_arg(b: RangeBound, open: &str) -> String {
    match b {
        RangeBound::Open => open.to_string(),
        RangeBound::Inclusive(id) => id.to_string(),
        RangeBound::Exclusive(id) => format!("({id}"),
    }
}

// ---- reply parsing -------------------------------------------------------------------

fn as_array(v: &Value) -> &[Value] {
    match v {
        Value::Array(a) | Value::Set(a) => a,
        _ => &[],
    }
}

fn as_bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

fn as_string(v: &Value) -> String {
    as_bytes(v)
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default()
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        other => as_bytes(other).and_then(|b| std::str::from_utf8(b).ok()?.parse().ok()),
    }
}

fn parse_id(v: &Value) -> Option<EntryId> {
    std::str::from_utf8(as_bytes(v)?).ok()?.parse().ok()
}

/// A flat `[k1, v1, k2, v2, ...]` reply (or a RESP3 map) as a map.
fn fields(v: &Value) -> HashMap<String, &Value> {
    match v {
        Value::Map(pairs) => pairs.iter().map(|(k, v)| (as_string(k), v)).collect(),
        other => as_array(other)
            .chunks_exact(2)
            .map(|kv| (as_string(&kv[0]), &kv[1]))
            .collect(),
    }
}

/// `[[id, [field, value, ...]], ...]` → entries. Entries whose body is gone (deleted while
/// pending) or lacks the payload field come back with an empty payload, which the
/// consumer dead-letters rather than silently dropping.
fn parse_entries(v: &Value, deliveries: u32) -> Vec<Entry> {
    as_array(v)
        .iter()
        .filter_map(|e| {
            let parts = as_array(e);
            let id = parse_id(parts.first()?)?;
            let payload = parts
                .get(1)
                .map(fields)
                .and_then(|f| {
                    f.get(PAYLOAD_FIELD)
                        .and_then(|v| as_bytes(v))
                        .map(Bytes::copy_from_slice)
                })
                .unwrap_or_default();
            Some(Entry {
                id,
                payload,
                deliveries,
            })
        })
        .collect()
}

/// XREAD/XREADGROUP reply for one stream: `[[stream, entries]]`, a RESP3 map, or nil.
fn parse_read_reply(v: &Value, deliveries: u32) -> Vec<Entry> {
    match v {
        Value::Nil => Vec::new(),
        Value::Map(pairs) => pairs
            .first()
            .map(|(_, e)| parse_entries(e, deliveries))
            .unwrap_or_default(),
        other => as_array(other)
            .first()
            .and_then(|s| as_array(s).get(1))
            .map(|e| parse_entries(e, deliveries))
            .unwrap_or_default(),
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
        let replies = self.query_pipe("XADD", stream, &pipe).await?;
        replies
            .iter()
            .map(|v| {
                parse_id(v).ok_or_else(|| BusError::Protocol {
                    op: "XADD",
                    key: stream.to_string(),
                    detail: format!("{v:?} is not an entry id"),
                })
            })
            .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("redis://u:secret@h:6379/0"),
            "redis://u:***@h:6379/0"
        );
        assert_eq!(redact_url("redis://:secret@h"), "redis://:***@h");
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
    }
}
