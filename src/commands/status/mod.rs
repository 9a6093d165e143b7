//! `rlstream status`: a running pipeline at a glance, from the bus alone.
//!
//! - every stream of the topology: length, and per consumer group the pending entries, the
//!   lag and each consumer's pending count and idle time (XINFO);
//! - every process that wrote an event in the window (`heartbeat` from each stage every
//!   2 s, `step` from the trainer): its stage, policy version, when it was last seen and its
//!   throughput over the window;
//! - the trainer's latest step and the newest published weights;
//! - the dead-letter count and the newest dead letter's reason.
//!
//! [`collect`] gathers a [`Status`] (serialisable, for `--json`); [`render`] draws it.

mod collect;
mod render;
mod snapshot;

pub use collect::collect;
pub use render::render;
pub use snapshot::{
    ConsumerStatus, DataLossStatus, DeadLetterStatus, GroupStatus, ProcessStatus, Status,
    StreamStatus, TrainerStatus, WeightsStatus, bytes,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::MemoryBus;
    use crate::bus::{Bus, Topology};
    use crate::roles::Stream;
    use crate::schema::{self, Event};
    use bytes::Bytes;
    use std::time::Duration;

    fn event(
        kind: &str,
        stage: &str,
        source: &str,
        version: u64,
        t: u64,
        f: &[(&str, f64)],
    ) -> Bytes {
        let e = Event {
            schema: schema::SchemaVersion::CURRENT,
            kind: kind.into(),
            stage: stage.into(),
            source: source.into(),
            version,
            fields: f.iter().map(|&(k, v)| (k.to_string(), v)).collect(),
            text: None,
            time_us: t,
            outcomes: Vec::new(),
        };
        Bytes::from(schema::encode(&e).expect("encode"))
    }

    #[tokio::test]
    #[allow(clippy::too_many_lines)]
    async fn rates_versions_and_backlog_from_events_and_streams() {
        let bus = MemoryBus::new();
        let topo = Topology::default();
        let now = schema::now_us();
        let ev = topo.key(Stream::Events);
        let events = vec![
            event(
                "heartbeat",
                "gen",
                "g1",
                3,
                now - 4_000_000,
                &[("tokens", 100.0)],
            ),
            event(
                "heartbeat",
                "gen",
                "g1",
                4,
                now - 2_000_000,
                &[("tokens", 500.0)],
            ),
            event(
                "heartbeat",
                "score",
                "s1",
                0,
                now - 4_000_000,
                &[("groups", 10.0)],
            ),
            event(
                "heartbeat",
                "score",
                "s1",
                0,
                now - 2_000_000,
                &[("groups", 30.0)],
            ),
            event(
                "step",
                "train",
                "t1",
                4,
                now - 3_000_000,
                &[("step", 4.0), ("tokens", 50.0)],
            ),
            event(
                "step",
                "train",
                "t1",
                5,
                now - 1_000_000,
                &[("step", 5.0), ("tokens", 300.0), ("reward_mean", 0.5)],
            ),
        ];
        bus.publish(&ev, &events, None).await.expect("publish");
        let prompts = topo.key(Stream::Prompts);
        bus.create_group(&prompts, "gen", crate::bus::GroupStart::Beginning)
            .await
            .expect("group");
        bus.publish(&prompts, &vec![Bytes::from_static(b"x"); 5], None)
            .await
            .expect("publish");
        bus.read_group(&prompts, "gen", "g1", crate::bus::ReadFrom::New, 2, None)
            .await
            .expect("read");

        let s = collect(&bus, &topo, "memory", Duration::from_secs(60))
            .await
            .expect("status");
        let p = s
            .streams
            .iter()
            .find(|st| st.name == "prompts")
            .expect("prompts");
        assert_eq!(p.length, 5);
        assert_eq!(p.groups[0].pending, 2);
        assert_eq!(p.groups[0].lag, Some(3));
        assert_eq!(p.groups[0].consumers[0].name, "g1");
        // Five one-byte entries on the embedded bus, under the shipped 256 MiB limit.
        let each = 1 + MemoryBus::ENTRY_OVERHEAD;
        assert_eq!((p.memory_bytes, p.max_bytes), (5 * each, Some(256 << 20)));
        assert_eq!(s.budget_bytes, topo.budget());
        assert!(s.memory_bytes >= p.memory_bytes);
        // 400 tokens in 2 s; 20 groups in 2 s; 300 tokens (after the first step) in 2 s.
        assert!((s.generated_tokens_per_s - 200.0).abs() < 1e-6, "{s:?}");
        assert!((s.scored_groups_per_s - 10.0).abs() < 1e-6);
        assert!((s.trained_tokens_per_s - 150.0).abs() < 1e-6);
        let g = s.processes.iter().find(|p| p.stage == "gen").expect("gen");
        assert_eq!(g.version, 4);
        assert!(!g.silent);
        let t = s.trainer.as_ref().expect("trainer");
        assert_eq!((t.step, t.version), (5, 5));
        assert_eq!(t.reward_mean, 0.5);
        assert_eq!(s.dead_letters, 0);
        let text = render(&s);
        for want in [
            "rl:prompts",
            "g1 (2,",
            "200.0 tok/s generated",
            "step 5 (version 5)",
            &format!("{} B / 256.0 MiB", 5 * each),
            "GiB budget",
            "trimmed entries are dropped (no --archive-dir)",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    #[tokio::test]
    async fn the_weights_line_shows_the_store_and_its_bound() {
        let bus = MemoryBus::new();
        let topo = Topology::default();
        let now = schema::now_us();
        let mut a = schema::examples::weights_announce();
        a.published_us = now - 1_000_000;
        bus.publish(
            &topo.key(Stream::Weights),
            &[Bytes::from(schema::encode(&a).expect("encode"))],
            None,
        )
        .await
        .expect("publish");
        let beat = event(
            "heartbeat",
            "train",
            "t1",
            8,
            now - 500_000,
            &[
                ("step", 8.0),
                ("weights_store_bytes", 12_500_000.0),
                ("weights_max_bytes", 50_000_000.0),
            ],
        );
        bus.publish(&topo.key(Stream::Events), &[beat], None)
            .await
            .expect("publish");
        let s = collect(&bus, &topo, "memory", Duration::from_secs(60))
            .await
            .expect("status");
        let w = s.weights.as_ref().expect("weights");
        assert_eq!(
            (w.store_bytes, w.max_bytes),
            (Some(12_500_000), Some(50_000_000))
        );
        let text = render(&s);
        for want in [
            "weights   version 8",
            "(xor-zstd, 4.2 MB, stored as 0.08 MB) in redis",
            "the store holds 12.5 MB of weights.max_bytes 50.0 MB",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    #[tokio::test]
    async fn an_idle_namespace_says_so() {
        let bus = MemoryBus::new();
        let topo = Topology::default()
            .with_namespace("nothing-here")
            .expect("ns");
        let s = collect(&bus, &topo, "memory", Duration::from_secs(30))
            .await
            .expect("status");
        assert!(s.processes.is_empty() && s.trainer.is_none() && s.weights.is_none());
        assert!(render(&s).contains("nothing is running under namespace `nothing-here`"));
    }
}
