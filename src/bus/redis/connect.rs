//! Opening a connection to Redis: the options, the TLS files of a `rediss://` URL, the
//! client, and errors that name the URL (its password redacted) and what to do.

use crate::bus::{BusError, BusResult};
use redis::{AsyncConnectionConfig, Client, ClientTlsConfig, TlsCertificates};
use std::path::{Path, PathBuf};
use std::time::Duration;

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

/// A connection for blocking reads: no response timeout of its own (the caller bounds it).
pub(super) fn blocking_config(connect_timeout: Duration) -> AsyncConnectionConfig {
    AsyncConnectionConfig::new()
        .set_response_timeout(None)
        .set_connection_timeout(Some(connect_timeout))
}

/// The client for `url`: plain for `redis://`, TLS with `tls`'s certificates for `rediss://`.
pub(super) fn open_client(url: &str, tls: &TlsFiles) -> BusResult<Client> {
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

pub(super) fn pem_has_certificate(pem: &[u8]) -> bool {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem).any(|c| c.is_ok())
}

/// The error for a failed first contact: refused credentials, a failed TLS handshake (with
/// what to do about it), or an unreachable server.
pub(super) fn unreachable(url: &str, source: redis::RedisError) -> BusError {
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
