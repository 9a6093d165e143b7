//! How the binary reports an error that ends a command: one line, the causes joined, each
//! said once; the full report (with a backtrace when Rust's variables capture one) only when
//! asked for with `RLSTREAM_BACKTRACE=1`.

/// `e` and its causes as one line: `top: cause: deeper cause`. A cause whose text the line
/// already holds is left out: a wrapper that repeats its source's message (`{0}` in a
/// `thiserror` variant with `#[source]`, `Connection refused` at three layers of a client)
/// would otherwise print it once per layer.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        let text = text.trim();
        if text.is_empty() || line.contains(text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(text);
    }
    line
}

/// What the binary prints for `e` on stderr before it exits with status 1.
pub fn report(e: &anyhow::Error) -> String {
    if std::env::var_os("RLSTREAM_BACKTRACE").is_some_and(|v| v != "0") {
        format!("error: {e:?}")
    } else {
        format!("error: {}", one_line(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("redis at 127.0.0.1:1: {0}")]
    struct Wrapper(#[source] std::io::Error);

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let e = anyhow::Error::new(Wrapper(io)).context("cannot reach the bus");
        assert_eq!(
            one_line(&e),
            "cannot reach the bus: redis at 127.0.0.1:1: Connection refused"
        );
    }

    #[test]
    fn distinct_causes_are_joined_in_order() {
        let e = anyhow::anyhow!("no such file").context("reading x.toml");
        assert_eq!(one_line(&e), "reading x.toml: no such file");
    }
}
