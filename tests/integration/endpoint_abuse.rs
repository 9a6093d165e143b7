//! Clients that would hold `gen --serve`'s endpoint, against the real binary on Redis:
//! idle connections, headers sent a byte at a time, a body that never finishes, bodies
//! past the limit (declared and chunked), and a burst of connections past the bound, all
//! beside a well-behaved client whose calls keep being served; the generator's resident
//! memory stays bounded.

use crate::common::{scrape, serve_gen, unique_ns};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The endpoint's limits in this test: 1 s to send headers or a body, 32 connections,
/// bodies of 64 KiB.
const FLAGS: [&str; 6] = [
    "--serve-read-timeout-s",
    "1",
    "--serve-max-connections",
    "32",
    "--serve-max-body-bytes",
    "65536",
];

/// A process's resident memory in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Sends `request` on a new connection and reads the answer to its end: its status and
/// body (`None` when the connection failed or closed without an answer).
fn exchange(addr: &str, request: &[u8]) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    s.write_all(request).ok()?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

fn post(addr: &str, body: &str) -> Vec<u8> {
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Whether the server closes `s` within `within` (EOF or a reset, perhaps after an answer).
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        s.set_read_timeout(Some(Duration::from_millis(100))).ok();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

#[test]
fn slow_oversized_and_idle_clients_cannot_hold_the_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("calc");
    crate::common::warm_start("calc", &model, 2, &[]);
    let log = dir.path().join("gen.log");
    let serving = serve_gen(&model, &unique_ns("serve-abuse"), &log, &FLAGS, &[]);
    let addr = serving.addr.clone();
    let pid = serving.proc.id().expect("gen runs");
    let call = post(
        &addr,
        r#"{"model": "calc", "prompt": "12*3=", "max_tokens": 6}"#,
    );
    assert_eq!(exchange(&addr, &call).map(|a| a.0), Some(200));
    let rss_before = rss_kib(pid);

    // The well-behaved client: one call after another, retried when a connection is
    // refused (the bound is on connections, whoever holds them).
    let stop = Arc::new(AtomicBool::new(false));
    let polite = {
        let (addr, call, stop) = (addr.clone(), call.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut served, mut slowest) = (0u32, Duration::ZERO);
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                loop {
                    match exchange(&addr, &call) {
                        Some((200, _)) => break,
                        Some((status, body)) => panic!("a polite call got {status}: {body}"),
                        None => std::thread::sleep(Duration::from_millis(50)),
                    }
                    assert!(started.elapsed() < Duration::from_secs(10), "never served");
                }
                served += 1;
                slowest = slowest.max(started.elapsed());
            }
            (served, slowest)
        })
    };

    let idle: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    // The slow clients say when they hold their connection: the burst below comes after,
    // so none of them is among the connections past the bound on a loaded machine.
    let (connected, slow_clients) = std::sync::mpsc::channel::<()>();
    let slowloris: Vec<_> = (0..4)
        .map(|_| {
            let (addr, connected) = (addr.clone(), connected.clone());
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(&addr).unwrap();
                connected.send(()).ok();
                let head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaa";
                for b in head {
                    if s.write_all(&[*b]).is_err() {
                        return true;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                closed_within(&mut s, Duration::from_secs(3))
            })
        })
        .collect();
    // A body that never finishes: 408 once the read timeout passes.
    let slow_body = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(&addr).unwrap();
            let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"";
            s.write_all(head.as_bytes()).unwrap();
            connected.send(()).ok();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut answer = vec![0u8; 4096];
            let n = s.read(&mut answer).unwrap_or(0);
            String::from_utf8_lossy(&answer[..n]).into_owned()
        })
    };
    // Past the body limit: declared (refused unread), and chunked (refused at the limit).
    let declared = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        100 << 20
    );
    let (status, body) = exchange(&addr, declared.as_bytes()).expect("an answer");
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("request_too_large"), "{body}");
    let mut chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..3 {
        chunked.extend_from_slice(format!("{:x}\r\n", 32 << 10).as_bytes());
        chunked.extend(std::iter::repeat_n(b' ', 32 << 10));
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let (status, body) = exchange(&addr, &chunked).expect("an answer");
    assert_eq!(status, 413, "{body}");

    // A burst past the connection bound: the extra connections are closed at once.
    for _ in 0..5 {
        slow_clients
            .recv_timeout(Duration::from_secs(10))
            .expect("the slow clients connect");
    }
    let mut burst: Vec<TcpStream> = (0..40)
        .filter_map(|_| TcpStream::connect(&addr).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let refused = burst
        .iter_mut()
        .filter_map(|s| closed_within(s, Duration::from_millis(20)).then_some(()))
        .count();
    assert!(
        refused >= 8,
        "{refused} of 40 connections past the bound were closed"
    );

    // Every idle connection is closed after the read timeout.
    for mut s in idle {
        assert!(
            closed_within(&mut s, Duration::from_secs(3)),
            "an idle connection stayed open"
        );
    }
    for t in slowloris {
        assert!(t.join().unwrap(), "a slow header was not cut off");
    }
    let answer = slow_body.join().unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 408") && answer.contains("request_timeout"),
        "{answer}"
    );
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let (served, slowest) = polite.join().unwrap();
    let rss_after = rss_kib(pid);
    eprintln!(
        "polite calls served: {served} (slowest {slowest:?}); {refused} of 40 burst connections refused; resident {rss_before} KiB -> {rss_after} KiB"
    );
    assert!(served >= 5, "only {served} polite calls were served");
    assert!(
        rss_after < rss_before + 64 * 1024,
        "resident memory grew from {rss_before} KiB to {rss_after} KiB"
    );
    let metrics = scrape(&serving.metrics);
    assert!(
        crate::common::metric(&metrics, "rlstream_serve_connections_refused_total") >= 1.0,
        "{metrics}"
    );
}
