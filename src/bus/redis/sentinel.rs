//! Redis named through Sentinel: the URL that names the sentinels and the primary, and
//! the question the bus asks them (which node is the primary now?) when it starts and
//! whenever the node it talks to fails or turns out to be a replica.
//!
//! `redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/PRIMARY[/DB]`: the sentinels'
//! addresses, the name they monitor the primary under (`sentinel monitor PRIMARY ...`), and
//! the database. The credentials are the data nodes'; the sentinels are asked without any.
//! Sentinel answers with the primary's address and redis-rs checks that the node there
//! says it is a primary (`ROLE`) before it is used.

use crate::bus::{BusError, BusResult};
use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{Client, IntoConnectionInfo, RedisError};
use tokio::sync::Mutex;

/// The URL scheme of a Redis named through Sentinel.
pub const SCHEME: &str = "redis+sentinel://";

/// The sentinels of one primary, asked for its address.
pub struct Sentinels {
    sentinels: Mutex<Sentinel>,
    primary: String,
    node: SentinelNodeConnectionInfo,
}

impl Sentinels {
    /// The sentinels a `redis+sentinel://` URL names; `None` for any other URL.
    pub fn parse(url: &str, redacted: &str) -> Option<BusResult<Sentinels>> {
        let rest = url.strip_prefix(SCHEME)?;
        Some(parse_rest(rest).map_err(|detail| bad_url(redacted, detail)))
    }

    /// The primary's client, as the sentinels name it now (checked to be a primary).
    pub async fn primary(&self) -> Result<Client, RedisError> {
        self.sentinels
            .lock()
            .await
            .async_master_for(&self.primary, Some(&self.node))
            .await
    }

    /// The name the sentinels monitor the primary under.
    pub fn name(&self) -> &str {
        &self.primary
    }
}

fn bad_url(url: &str, detail: String) -> BusError {
    BusError::BadUrl {
        url: url.to_string(),
        source: RedisError::from((
            redis::ErrorKind::InvalidClientConfig,
            "bad Sentinel URL",
            format!(
                "{detail}; the form is {SCHEME}[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/PRIMARY[/DB]"
            ),
        )),
    }
}

fn parse_rest(rest: &str) -> Result<Sentinels, String> {
    let (auth, rest) = match rest.rsplit_once('@') {
        Some((auth, rest)) => (Some(auth), rest),
        None => (None, rest),
    };
    let (hosts, path) = rest
        .split_once('/')
        .ok_or_else(|| "no primary name after the sentinels' addresses".to_string())?;
    let (primary, db) = match path.split_once('/') {
        Some((p, db)) => (p, db),
        None => (path, "0"),
    };
    if primary.is_empty() {
        return Err("no primary name after the sentinels' addresses".into());
    }
    let db: i64 = db
        .parse()
        .map_err(|_| format!("`{db}` is not a database number"))?;
    let sentinels: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| format!("redis://{h}"))
        .collect();
    if sentinels.is_empty() {
        return Err("no sentinel address".into());
    }
    // The data nodes' credentials and database, read as redis-rs reads them in a URL.
    let auth = auth.map_or(String::new(), |a| format!("{a}@"));
    let settings = format!("redis://{auth}sentinel-primary/{db}")
        .into_connection_info()
        .map_err(|e| format!("the credentials or database do not read: {e}"))?
        .redis_settings()
        .clone();
    let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(settings);
    let sentinel = Sentinel::build(sentinels).map_err(|e| e.to_string())?;
    Ok(Sentinels {
        sentinels: Mutex::new(sentinel),
        primary: primary.to_string(),
        node,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_read_and_bad_ones_say_the_form() {
        let ok = Sentinels::parse(
            "redis+sentinel://:pw@127.0.0.1:26379,127.0.0.1:26380/prim/2",
            "x",
        )
        .expect("a sentinel URL")
        .expect("reads");
        assert_eq!(ok.name(), "prim");
        assert!(Sentinels::parse("redis://127.0.0.1", "x").is_none());
        for bad in [
            "redis+sentinel://127.0.0.1:26379",
            "redis+sentinel://127.0.0.1:26379/",
            "redis+sentinel:///prim",
            "redis+sentinel://127.0.0.1:26379/prim/x",
        ] {
            let Some(Err(e)) = Sentinels::parse(bad, bad) else {
                panic!("{bad} should not read");
            };
            assert!(e.to_string().contains("PRIMARY[/DB]"), "{bad}: {e}");
        }
    }
}
