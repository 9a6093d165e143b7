//! Bad bytes get a typed error naming the problem, never a panic, from every decoder.

use rlstream::schema::{
    self, CodecError, DeadLetter, Event, Message, Prompt, RolloutGroup, ScoredGroup,
    WeightsAnnounce, examples,
};
use rmpv::Value;

fn to_value<M: Message>(m: &M) -> Value {
    let bytes = schema::encode(m).unwrap();
    rmpv::decode::read_value(&mut bytes.as_slice()).unwrap()
}

fn to_bytes(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// Mutable access to a field of a map value by path.
fn field<'a>(v: &'a mut Value, path: &[&str]) -> &'a mut Value {
    let mut cur = v;
    for key in path {
        cur = match cur {
            Value::Array(items) => &mut items[key.parse::<usize>().unwrap()],
            Value::Map(pairs) => {
                &mut pairs
                    .iter_mut()
                    .find(|(k, _)| k.as_str() == Some(key))
                    .unwrap()
                    .1
            }
            other => panic!("{other:?} has no field {key}"),
        };
    }
    cur
}

fn remove(v: &mut Value, path: &[&str], key: &str) {
    if let Value::Map(pairs) = field(v, path) {
        pairs.retain(|(k, _)| k.as_str() != Some(key));
    }
}

/// Truncations at every length and random bytes: errors, never panics, for one type.
fn fuzz_decoder<M: Message + std::fmt::Debug>(valid: &[u8]) {
    for cut in 0..valid.len() {
        let err = schema::decode::<M>(&valid[..cut]).unwrap_err();
        assert!(
            matches!(
                err,
                CodecError::Truncated { .. }
                    | CodecError::Malformed { .. }
                    | CodecError::NotMessagePack { .. }
                    | CodecError::MissingField { .. }
            ),
            "{}: cut at {cut}: {err:?}",
            M::KIND
        );
    }
    let mut state = 0x1234_5678_9abc_def1u64 ^ valid.len() as u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for round in 0..3000 {
        let len = (next() % 300) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        if round % 2 == 0 && !bytes.is_empty() {
            bytes[0] = 0x80 | (bytes[0] & 0x0f); // a fixmap header, to get past the first check
        }
        let _ = schema::decode::<M>(&bytes); // must return, not panic
        // Flipping bytes of a valid message, too.
        let mut flipped = valid.to_vec();
        for _ in 0..3 {
            let at = (next() as usize) % flipped.len();
            flipped[at] = next() as u8;
        }
        let _ = schema::decode::<M>(&flipped);
    }
    assert!(matches!(
        schema::decode::<M>(b""),
        Err(CodecError::Truncated { .. })
    ));
    let err = schema::decode::<M>(&[0x93, 1, 2, 3]).unwrap_err();
    assert!(err.to_string().contains("not a MessagePack map"), "{err}");
}

fn wrong_version<M: Message + std::fmt::Debug>(mut v: Value) {
    let major = M::SCHEMA.major;
    *field(&mut v, &["schema"]) = Value::Array(vec![(major + 1).into(), 0.into()]);
    let err = schema::decode::<M>(&to_bytes(&v)).unwrap_err();
    assert!(matches!(err, CodecError::SchemaTooNew { .. }), "{err:?}");
    let said = format!("schema {}.0 is newer than the {major}.", major + 1);
    assert!(err.to_string().contains(&said), "{err}");
    // A newer major that also renamed a required field still reports the version.
    remove(&mut v, &[], "schema");
    if let Value::Map(pairs) = &mut v {
        pairs.truncate(1);
        pairs.push((
            "schema".into(),
            Value::Array(vec![(major + 2).into(), 1.into()]),
        ));
    }
    let err = schema::decode::<M>(&to_bytes(&v)).unwrap_err();
    assert!(matches!(err, CodecError::SchemaTooNew { .. }), "{err:?}");
}

#[test]
fn every_decoder_survives_truncated_random_and_wrong_version_bytes() {
    fuzz_decoder::<Prompt>(&schema::encode(&examples::prompt()).unwrap());
    fuzz_decoder::<RolloutGroup>(&schema::encode(&examples::rollout_group(2, 4, 16, 2)).unwrap());
    fuzz_decoder::<ScoredGroup>(&schema::encode(&examples::scored_group()).unwrap());
    fuzz_decoder::<WeightsAnnounce>(&schema::encode(&examples::weights_announce()).unwrap());
    fuzz_decoder::<DeadLetter>(&schema::encode(&examples::dead_letter()).unwrap());
    fuzz_decoder::<Event>(&schema::encode(&examples::event()).unwrap());
    wrong_version::<Prompt>(to_value(&examples::prompt()));
    wrong_version::<RolloutGroup>(to_value(&examples::rollout_group(2, 4, 16, 2)));
    wrong_version::<ScoredGroup>(to_value(&examples::scored_group()));
    wrong_version::<WeightsAnnounce>(to_value(&examples::weights_announce()));
    wrong_version::<DeadLetter>(to_value(&examples::dead_letter()));
    wrong_version::<Event>(to_value(&examples::event()));
}

#[test]
fn same_major_newer_minor_with_unknown_fields_is_accepted() {
    let mut v = to_value(&examples::rollout_group(2, 4, 16, 2));
    *field(&mut v, &["schema"]) = Value::Array(vec![1.into(), 7.into()]);
    if let Value::Map(pairs) = &mut v {
        pairs.push(("added_in_1_7".into(), Value::Array(vec![1.into()])));
    }
    let g: RolloutGroup = schema::decode(&to_bytes(&v)).unwrap();
    assert_eq!(g.schema.minor, 7);
}

#[test]
fn missing_field_is_named() {
    let mut v = to_value(&examples::rollout_group(2, 4, 16, 2));
    remove(&mut v, &["samples", "1"], "logprobs");
    let err = schema::decode::<RolloutGroup>(&to_bytes(&v)).unwrap_err();
    assert_eq!(
        err,
        CodecError::MissingField {
            kind: "RolloutGroup",
            field: "logprobs".into()
        }
    );
    let mut v = to_value(&examples::weights_announce());
    remove(&mut v, &[], "checksum");
    let err = schema::decode::<WeightsAnnounce>(&to_bytes(&v)).unwrap_err();
    assert_eq!(err.to_string(), "WeightsAnnounce: missing field `checksum`");
}

#[test]
fn length_mismatches_are_named() {
    let mut g = examples::rollout_group(2, 4, 16, 2);
    g.samples[1].logprobs.0.pop();
    let err = schema::decode::<RolloutGroup>(&schema::encode(&g).unwrap()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "RolloutGroup: samples[1].logprobs: expected 4 values, found 3"
    );

    let mut g = examples::rollout_group(2, 4, 16, 2);
    g.samples[0].versions = vec![(0, 1).into(), (9, 2).into()];
    let err = schema::decode::<RolloutGroup>(&schema::encode(&g).unwrap()).unwrap_err();
    assert!(
        err.to_string()
            .contains("samples[0].versions: run starts at 9 past the last token 3"),
        "{err}"
    );

    let mut g = examples::rollout_group(2, 4, 16, 2);
    g.samples[0].mask.as_mut().unwrap().offsets.0.pop();
    let err = schema::decode::<RolloutGroup>(&schema::encode(&g).unwrap()).unwrap_err();
    assert!(matches!(err, CodecError::LengthMismatch { .. }), "{err}");

    let mut s = examples::scored_group();
    s.advantages.push(0.0);
    let err = schema::decode::<ScoredGroup>(&schema::encode(&s).unwrap()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "ScoredGroup: advantages: expected 2 values, found 3"
    );
}

#[test]
fn non_finite_and_impossible_numbers_are_refused() {
    let mut g = examples::rollout_group(2, 4, 16, 2);
    g.samples[1].logprobs.0[2] = f32::NAN;
    let err = schema::decode::<RolloutGroup>(&schema::encode(&g).unwrap()).unwrap_err();
    assert!(
        err.to_string()
            .contains("samples[1].logprobs[2]: NaN is not finite"),
        "{err}"
    );

    let mut g = examples::rollout_group(2, 4, 16, 2);
    g.samples[0].logprobs.0[0] = 0.5;
    let err = schema::decode::<RolloutGroup>(&schema::encode(&g).unwrap()).unwrap_err();
    assert!(
        err.to_string().contains("log-prob 0.5 is positive"),
        "{err}"
    );

    let mut s = examples::scored_group();
    s.rewards[0] = f32::INFINITY;
    let err = schema::decode::<ScoredGroup>(&schema::encode(&s).unwrap()).unwrap_err();
    assert!(
        err.to_string().contains("rewards[0]: inf is not finite"),
        "{err}"
    );

    let mut g = examples::rollout_group(2, 4, 16, 2);
    // Step 0's kept set without the sampled token.
    let m = g.samples[0].mask.as_mut().unwrap();
    let end = m.offsets[1] as usize;
    for (j, id) in m.ids.0[..end].iter_mut().enumerate() {
        *id = 999 + j as u32;
    }
    let err = schema::decode::<RolloutGroup>(&schema::encode(&g).unwrap()).unwrap_err();
    assert!(err.to_string().contains("is not in the kept set"), "{err}");
}

#[test]
fn oversized_and_trailing_bytes_are_refused() {
    let bytes = schema::encode(&examples::prompt()).unwrap();
    let err = schema::decode_limited::<Prompt>(&bytes, 10).unwrap_err();
    assert!(
        matches!(err, CodecError::TooLarge { limit: 10, .. }),
        "{err:?}"
    );
    let mut extra = bytes.clone();
    extra.extend_from_slice(&[0, 0]);
    let err = schema::decode::<Prompt>(&extra).unwrap_err();
    assert!(err.to_string().contains("2 trailing bytes"), "{err}");
}
