//! Golden fixtures: `schemas/fixtures/NAME.msgpack` must decode to the example message,
//! re-encode to the same bytes, and match its `.json` twin under the documented mapping.
//! Regenerate after a deliberate schema change with `RLSTREAM_BLESS=1 cargo test --test schema_fixtures`.

use rlstream::schema::{self, Message, examples, json::msgpack_to_json};
use std::fmt::Debug;
use std::path::PathBuf;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schemas/fixtures")
}

fn check<M: Message + PartialEq + Debug>(name: &str, example: M) {
    let bytes = schema::encode(&example).unwrap();
    let json = serde_json::to_string_pretty(&msgpack_to_json(&bytes).unwrap()).unwrap() + "\n";
    let (bin_path, json_path) = (
        fixture_dir().join(format!("{name}.msgpack")),
        fixture_dir().join(format!("{name}.json")),
    );
    if std::env::var_os("RLSTREAM_BLESS").is_some() {
        std::fs::create_dir_all(fixture_dir()).unwrap();
        std::fs::write(&bin_path, &bytes).unwrap();
        std::fs::write(&json_path, &json).unwrap();
    }
    let golden = std::fs::read(&bin_path).unwrap_or_else(|e| panic!("{}: {e}", bin_path.display()));
    let decoded: M = schema::decode(&golden).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(
        decoded, example,
        "{name}: fixture decodes to a different value"
    );
    assert_eq!(
        schema::encode(&decoded).unwrap(),
        golden,
        "{name}: re-encoding changed the bytes"
    );
    let golden_json = std::fs::read_to_string(&json_path).unwrap();
    let parsed: serde_json::Value = serde_json::from_str(&golden_json).unwrap();
    assert_eq!(
        msgpack_to_json(&golden).unwrap(),
        parsed,
        "{name}: .json twin disagrees"
    );
}

#[test]
fn prompt() {
    check("Prompt", examples::prompt());
}

/// Sampling masks travel as packed kept sets: a masked group is 3.0.
#[test]
fn rollout_group() {
    let g = examples::rollout_group(2, 4, 16, 2);
    assert_eq!(g.schema, schema::SchemaVersion { major: 3, minor: 0 });
    check("RolloutGroup", g);
}

/// A message an older build wrote, with its masks in CSR form, still decodes: to the example
/// with the version it claims, holding the same kept sets.
fn check_older<M: Message + PartialEq + Debug>(
    name: &str,
    example: M,
    claims: schema::SchemaVersion,
    restamp: impl Fn(&mut M, schema::SchemaVersion),
) {
    let golden = std::fs::read(fixture_dir().join(format!("{name}.msgpack"))).unwrap();
    let mut decoded: M = schema::decode(&golden).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(decoded.schema(), claims, "{name}");
    restamp(&mut decoded, example.schema());
    // Encoding writes each kept set sorted and once: equal bytes, equal sets.
    assert_eq!(
        schema::encode(&decoded).unwrap(),
        schema::encode(&example).unwrap(),
        "{name}: decodes to another message"
    );
}

fn restamp_rollout(g: &mut schema::RolloutGroup, v: schema::SchemaVersion) {
    g.schema = v;
}

fn restamp_scored(s: &mut schema::ScoredGroup, v: schema::SchemaVersion) {
    s.schema = v;
    s.rollout.schema = schema::RolloutGroup::version_for(&s.rollout.samples);
}

#[test]
fn rollout_group_with_csr_masks() {
    let v = |major, minor| schema::SchemaVersion { major, minor };
    check_older(
        "RolloutGroup.v1",
        examples::rollout_group(2, 4, 16, 2),
        v(1, 0),
        restamp_rollout,
    );
    check_older(
        "RolloutGroup.v2_2",
        examples::routed_group(),
        v(2, 2),
        restamp_rollout,
    );
    check_older(
        "ScoredGroup.v2",
        examples::scored_group(),
        v(2, 0),
        restamp_scored,
    );
    let routed = examples::routed_group();
    check_older(
        "ScoredGroup.v3_1",
        schema::ScoredGroup {
            schema: schema::ScoredGroup::version_for(&routed, &None),
            rollout: routed,
            ..examples::scored_group_v1()
        },
        v(3, 1),
        restamp_scored,
    );
}

#[test]
fn scored_group() {
    check("ScoredGroup", examples::scored_group());
}

/// Episodes: a rollout with environment spans is 2.1 (2.0 had no turn rewards), its scored
/// group 3.0.
#[test]
fn episodes() {
    let g = examples::episode_group();
    assert_eq!(g.schema, schema::SchemaVersion { major: 2, minor: 1 });
    check("RolloutGroup.episode", g);
    let s = examples::scored_episode();
    assert_eq!(s.schema, schema::SchemaVersion { major: 3, minor: 0 });
    check("ScoredGroup.episode", s);
}

/// A mixture-of-experts group carries its routing (2.2 and 3.1 added it: older readers of
/// the same major ignore it and route live); with its masks the rollout is 3.0 and its
/// scored group 4.0.
#[test]
fn routed_groups() {
    let g = examples::routed_group();
    assert_eq!(g.schema, schema::SchemaVersion { major: 3, minor: 0 });
    check("RolloutGroup.routing", g.clone());
    let s = schema::ScoredGroup {
        schema: schema::ScoredGroup::version_for(&g, &None),
        rollout: g,
        ..examples::scored_group_v1()
    };
    assert_eq!(s.schema, schema::SchemaVersion { major: 4, minor: 0 });
    check("ScoredGroup.routing", s);
}

/// A group as schema 1.0 wrote it still decodes, and a group without token rewards or
/// masks is still written as 1.0, so a 1.x trainer keeps reading what it reads right.
#[test]
fn scored_group_v1() {
    let mut v1 = examples::scored_group_v1();
    v1.schema = schema::ScoredGroup::version_for(&v1.rollout, &v1.token_rewards);
    check_older(
        "ScoredGroup.v1",
        v1,
        schema::SchemaVersion::CURRENT,
        restamp_scored,
    );
    let mut g = examples::scored_group();
    assert_eq!(g.schema, schema::SchemaVersion { major: 4, minor: 0 });
    g.token_rewards = None;
    g.rollout.samples.iter_mut().for_each(|s| s.mask = None);
    assert_eq!(
        schema::ScoredGroup::version_for(&g.rollout, &g.token_rewards),
        schema::SchemaVersion::CURRENT
    );
}

#[test]
fn weights_announce() {
    check("WeightsAnnounce", examples::weights_announce());
}

/// A full version as schema 1.0 wrote it still decodes: the 2.0 fields take their
/// defaults (a whole version in Redis chunks).
#[test]
fn weights_announce_1_0() {
    let golden = std::fs::read(fixture_dir().join("WeightsAnnounce.v1.msgpack")).unwrap();
    let decoded: schema::WeightsAnnounce = schema::decode(&golden).unwrap();
    assert_eq!(decoded, examples::weights_announce_v1());
    assert!(!decoded.is_delta());
    assert_eq!(decoded.object_bytes(), decoded.bytes);
}

#[test]
fn weights_announce_lora() {
    check("WeightsAnnounce.lora", examples::weights_announce_lora());
}

/// A 2.0 announce (this build writes 2.1) decodes to the same value with no adapter.
#[test]
fn weights_announce_2_0() {
    let golden = std::fs::read(fixture_dir().join("WeightsAnnounce.v2_0.msgpack")).unwrap();
    let decoded: schema::WeightsAnnounce = schema::decode(&golden).unwrap();
    assert_eq!(decoded, examples::weights_announce_v2_0());
    assert_eq!(decoded.lora, None);
}

#[test]
fn dead_letter() {
    check("DeadLetter", examples::dead_letter());
}

/// Heartbeats and steps are still written as 1.0; a scorer's outcomes as 1.1, which a 1.0
/// reader reads as an event with no fields.
#[test]
fn event() {
    let e = examples::event();
    assert_eq!(e.schema, schema::SchemaVersion::CURRENT);
    check("Event", e);
    let o = examples::event_outcomes();
    assert_eq!(o.schema, schema::SchemaVersion { major: 1, minor: 1 });
    check("Event.outcomes", o);
}
