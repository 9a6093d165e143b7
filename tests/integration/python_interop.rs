//! A producer and a consumer written in Python, from the schema files alone, exchange
//! RolloutGroups with the Rust bus through a real Redis. Needs the Python environment
//! from `scripts/setup-python.sh` (or `RLSTREAM_PYTHON` pointing at a Python that has
//! schemas/requirements.txt installed).

use bytes::Bytes;
use rlstream::bus::{Consumer, ConsumerOptions, RangeBound};
use rlstream::schema::{self, FinishReason, RolloutGroup, examples};
use std::path::PathBuf;

use crate::common::python_ok;

fn check_py(args: &[&str]) -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schemas/check.py");
    let script = script.to_str().expect("a UTF-8 path");
    let args: Vec<&str> = std::iter::once(script)
        .chain(args.iter().copied())
        .collect();
    python_ok(&args)
}

#[tokio::test]
async fn python_writes_a_rollout_that_the_rust_bus_reads() {
    let ns = crate::common::unique_ns("py-write");
    let stream = format!("{ns}:rollouts");
    let url = crate::common::redis_url();
    let id = check_py(&["write-rollout", "--redis", &url, "--stream", &stream]);
    let bus = crate::common::redis_bus().await;
    let mut c = Consumer::<RolloutGroup>::join(
        bus.clone(),
        &stream,
        "score",
        "rust",
        format!("{ns}:dead"),
        ConsumerOptions::default(),
    )
    .await
    .unwrap();
    let batch = c.poll().await.unwrap();
    assert_eq!(
        batch.len(),
        1,
        "the Python message decoded (nothing dead-lettered)"
    );
    assert_eq!(batch[0].id.to_string(), id.trim());
    let g = &batch[0].message;
    assert_eq!(g.group_id, "py-verifier-0001");
    assert_eq!(g.samples[0].tokens.as_slice(), &[5, 6, 7, 0]);
    assert_eq!(
        g.samples[0].logprobs.as_slice(),
        &[-0.5, -0.25, -1.0, -0.125]
    );
    assert_eq!(g.samples[0].version_at(3), 4);
    assert_eq!(g.samples[0].mask.as_ref().unwrap().step(2), &[7, 3]);
    assert_eq!(
        g.samples[1].tokens.as_slice(),
        &[9, 9],
        "list form accepted"
    );
    assert_eq!(g.samples[1].finish, FinishReason::Length);
    assert_eq!(g.sampling.temperature, 0.7);
    assert_eq!(g.meta["answer"], "42");
    c.ack(&[batch[0].id]).await.unwrap();
    crate::common::drop_namespace(&ns).await;
}

#[tokio::test]
async fn python_reads_and_validates_a_rollout_written_by_rust() {
    let ns = crate::common::unique_ns("py-read");
    let stream = format!("{ns}:rollouts");
    let bus = crate::common::redis_bus().await;
    let group = examples::rollout_group(3, 5, 100, 4);
    let ids = bus
        .publish(
            &stream,
            &[Bytes::from(schema::encode(&group).unwrap())],
            None,
        )
        .await
        .unwrap();
    let out = check_py(&[
        "read-rollout",
        "--redis",
        &crate::common::redis_url(),
        "--stream",
        &stream,
        "--id",
        &ids[0].to_string(),
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["group_id"], "gen-0-000017");
    for (i, s) in group.samples.iter().enumerate() {
        let tokens: Vec<u32> = serde_json::from_value(v["tokens"][i].clone()).unwrap();
        let logprobs: Vec<f32> = serde_json::from_value(v["logprobs"][i].clone()).unwrap();
        assert_eq!(tokens, s.tokens.as_slice());
        assert_eq!(logprobs, s.logprobs.as_slice());
    }
    assert_eq!(v["versions"][1], serde_json::json!([[0, 7], [2, 8]]));
    assert_eq!(
        bus.range(&stream, RangeBound::Open, RangeBound::Open, 10)
            .await
            .unwrap()
            .len(),
        1
    );
    crate::common::drop_namespace(&ns).await;
}
