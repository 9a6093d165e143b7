//! Drawing a [`Status`] as the terminal table `rlstream status` prints.

use super::snapshot::{Status, bytes, seconds};
use crate::roles::Stage;
use std::fmt::Write as _;

/// The snapshot as a terminal table.
pub fn render(s: &Status) -> String {
    let mut o = String::new();
    let when = crate::time::utc(s.time_us);
    let _ = writeln!(
        o,
        "rlstream status  {}  namespace {}  {when}",
        s.bus, s.namespace
    );
    let _ = writeln!(o);
    streams(&mut o, s);
    memory(&mut o, s);
    processes(&mut o, s);
    trainer(&mut o, s);
    weights(&mut o, s);
    flow_and_dead_letters(&mut o, s);
    o
}

/// Each stream: length, memory against its limit, and each group with its consumers.
fn streams(o: &mut String, s: &Status) {
    let w = s
        .streams
        .iter()
        .map(|st| st.key.len())
        .max()
        .unwrap_or(0)
        .max(16);
    let _ = writeln!(
        o,
        "{:<w$} {:>9} {:>21}  {:<8} {:>8} {:>8}  CONSUMERS (pending, idle)",
        "STREAM", "LENGTH", "MEMORY / LIMIT", "GROUP", "PENDING", "LAG"
    );
    for st in &s.streams {
        let memory = format!(
            "{} / {}",
            bytes(st.memory_bytes),
            st.max_bytes.map_or("none".to_string(), bytes)
        );
        if st.groups.is_empty() {
            let _ = writeln!(
                o,
                "{:<w$} {:>9} {memory:>21}  {:<8} {:>8} {:>8}",
                st.key, st.length, "-", "", ""
            );
        }
        for (i, g) in st.groups.iter().enumerate() {
            let consumers = if g.consumers.is_empty() {
                "none".to_string()
            } else {
                g.consumers
                    .iter()
                    .map(|c| format!("{} ({}, {})", c.name, c.pending, seconds(c.idle_s)))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let (key, len, mem) = if i == 0 {
                (st.key.as_str(), st.length.to_string(), memory.as_str())
            } else {
                ("", String::new(), "")
            };
            let lag = g.lag.map_or("?".to_string(), |l| l.to_string());
            let _ = writeln!(
                o,
                "{key:<w$} {len:>9} {mem:>21}  {:<8} {:>8} {lag:>8}  {consumers}",
                g.name, g.pending
            );
        }
    }
}

/// What the streams take against the budget, and where trims put what they remove.
fn memory(o: &mut String, s: &Status) {
    let budget = match s.budget_bytes {
        Some(b) => format!(
            "{} of the {} budget ({:.1}%)",
            bytes(s.memory_bytes),
            bytes(b),
            100.0 * s.memory_bytes as f64 / b.max(1) as f64
        ),
        None => format!(
            "{} (no budget: a stream has no trim_max_bytes)",
            bytes(s.memory_bytes)
        ),
    };
    let archive = match &s.archive_dir {
        Some(d) => format!("trimmed entries are archived to {d}"),
        None => "trimmed entries are dropped (no --archive-dir)".to_string(),
    };
    let _ = writeln!(o, "streams take {budget}; {archive}");
    let _ = writeln!(o);
}

/// Every process seen in the window, with its version and throughput.
fn processes(o: &mut String, s: &Status) {
    if s.processes.is_empty() {
        let _ = writeln!(
            o,
            "no process wrote an event in the last {}: nothing is running under namespace `{}` \
             (or it runs under another --namespace)",
            seconds(s.window_s),
            s.namespace
        );
    } else {
        let _ = writeln!(
            o,
            "{:<6} {:<28} {:>8}  {:>16}  THROUGHPUT (last {})",
            "STAGE",
            "PROCESS",
            "VERSION",
            "LAST SEEN",
            seconds(s.window_s)
        );
        for p in &s.processes {
            let version = if p.stage == Stage::Score.as_str() {
                "-".to_string()
            } else {
                p.version.to_string()
            };
            let rate = p
                .rate
                .map_or("-".to_string(), |r| format!("{r:.1} {}", p.rate_unit));
            let seen = if p.silent {
                format!("{} SILENT", seconds(p.last_seen_s))
            } else {
                seconds(p.last_seen_s)
            };
            let _ = writeln!(
                o,
                "{:<6} {:<28} {version:>8}  {seen:>16}  {rate}",
                p.stage, p.source
            );
        }
    }
    let _ = writeln!(o);
}

/// The trainer's newest step.
fn trainer(o: &mut String, s: &Status) {
    match &s.trainer {
        Some(t) => {
            let _ = writeln!(
                o,
                "trainer   step {} (version {}) {} ago; reward {:.3}, accuracy {:.3}, loss {:.4}, staleness max {}{}",
                t.step,
                t.version,
                seconds(t.last_step_s),
                t.reward_mean,
                t.accuracy,
                t.loss,
                t.staleness_max,
                t.steps_per_s
                    .map_or(String::new(), |r| format!(", {r:.2} steps/s"))
            );
        }
        None => {
            let _ = writeln!(o, "trainer   no step in the window");
        }
    }
}

/// The newest published weights and what their store holds.
fn weights(o: &mut String, s: &Status) {
    match &s.weights {
        Some(w) => {
            let stored = if w.stored_bytes == w.bytes {
                String::new()
            } else {
                format!(", stored as {:.2} MB", w.stored_bytes as f64 / 1e6)
            };
            let _ = writeln!(
                o,
                "weights   version {} published {} ago ({}, {:.1} MB{stored}) in {}",
                w.version,
                seconds(w.published_s),
                w.format,
                w.bytes as f64 / 1e6,
                w.store
            );
            if let Some(held) = w.store_bytes {
                let bound = match w.max_bytes {
                    Some(m) if m > 0 => format!(" of weights.max_bytes {:.1} MB", m as f64 / 1e6),
                    _ => " (no bound: weights.max_bytes = 0)".into(),
                };
                let _ = writeln!(
                    o,
                    "          the store holds {:.1} MB{bound}",
                    held as f64 / 1e6
                );
            }
        }
        None => {
            let _ = writeln!(o, "weights   none published yet");
        }
    }
}

/// The totals over the window and the dead letters.
fn flow_and_dead_letters(o: &mut String, s: &Status) {
    let _ = writeln!(
        o,
        "flow      {:.0} tok/s generated, {:.1} groups/s scored, {:.0} tok/s trained",
        s.generated_tokens_per_s, s.scored_groups_per_s, s.trained_tokens_per_s
    );
    match &s.last_dead_letter {
        Some(d) => {
            let _ = writeln!(
                o,
                "dead      {} entries; newest {} ago from {} {}: {} ({})",
                s.dead_letters,
                seconds(d.age_s),
                d.source_stream,
                d.source_id,
                d.reason,
                d.error
            );
        }
        None => {
            let _ = writeln!(o, "dead      {} entries", s.dead_letters);
        }
    }
    if let Some(newest) = s.data_losses.last() {
        let (held, replayed) = s
            .data_losses
            .iter()
            .fold((0, 0), |(h, r), l| (h + l.held, r + l.replayed));
        let _ = writeln!(
            o,
            "LOST      Redis lost its data {} times in the window ({held} entries in hand, {replayed} handed out again); newest {} ago, seen by {} {}: {}",
            s.data_losses.len(),
            seconds(newest.age_s),
            newest.stage,
            newest.source,
            newest.what
        );
    }
}
