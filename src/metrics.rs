//! Telemetry in one place: every metric name, its unit and description, and the Prometheus
//! exporter. Stages record through the helpers here so names never drift.
//!
//! Naming follows Prometheus: `rlstream_` prefix, base units, `_total` for counters.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use std::net::SocketAddr;

pub const TOKENS_TOTAL: &str = "rlstream_tokens_total";
pub const SAMPLES_TOTAL: &str = "rlstream_samples_total";
pub const SAMPLES_DROPPED_TOTAL: &str = "rlstream_samples_dropped_total";
pub const ERRORS_TOTAL: &str = "rlstream_errors_total";
pub const POLICY_VERSION: &str = "rlstream_policy_version";
pub const SAMPLE_STALENESS_VERSIONS: &str = "rlstream_sample_staleness_versions";
pub const WEIGHT_SWAP_STALL_SECONDS: &str = "rlstream_weight_swap_stall_seconds";
pub const TRAIN_STEP_SECONDS: &str = "rlstream_train_step_seconds";
pub const TRAIN_WAIT_SECONDS_TOTAL: &str = "rlstream_train_wait_seconds_total";
pub const REWARD_MEAN: &str = "rlstream_reward_mean";
pub const IS_ESS: &str = "rlstream_is_ess";
pub const CLIP_FRACTION: &str = "rlstream_clip_fraction";
pub const KL: &str = "rlstream_kl";
pub const ENTROPY: &str = "rlstream_entropy";
pub const GRAD_NORM: &str = "rlstream_grad_norm";
pub const BUILD_INFO: &str = "rlstream_build_info";

/// Buckets of the staleness histogram, in versions.
const STALENESS_BUCKETS: [f64; 9] = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0];
/// Buckets of the swap stall, in seconds: microseconds expected.
const STALL_BUCKETS: [f64; 8] = [1e-6, 5e-6, 2e-5, 1e-4, 5e-4, 2e-3, 1e-2, 1e-1];
/// Buckets of the train step time, in seconds.
const STEP_BUCKETS: [f64; 9] = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0];

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("--metrics-addr `{0}` is not an address (expected HOST:PORT, e.g. 127.0.0.1:9100)")]
    BadAddr(String),
    #[error("cannot serve metrics on {addr}: {reason}")]
    Install { addr: String, reason: String },
}

/// Serves `/metrics` on `addr` (needs a tokio runtime) and describes every metric.
pub fn install(addr: &str) -> Result<(), MetricsError> {
    let socket: SocketAddr = addr
        .parse()
        .map_err(|_| MetricsError::BadAddr(addr.to_string()))?;
    let bucket_err = |e: metrics_exporter_prometheus::BuildError| MetricsError::Install {
        addr: addr.to_string(),
        reason: e.to_string(),
    };
    PrometheusBuilder::new()
        .with_http_listener(socket)
        .set_buckets_for_metric(
            Matcher::Full(SAMPLE_STALENESS_VERSIONS.into()),
            &STALENESS_BUCKETS,
        )
        .map_err(bucket_err)?
        .set_buckets_for_metric(
            Matcher::Full(WEIGHT_SWAP_STALL_SECONDS.into()),
            &STALL_BUCKETS,
        )
        .map_err(bucket_err)?
        .set_buckets_for_metric(Matcher::Full(TRAIN_STEP_SECONDS.into()), &STEP_BUCKETS)
        .map_err(bucket_err)?
        .install()
        .map_err(|e| MetricsError::Install {
            addr: addr.to_string(),
            reason: e.to_string(),
        })?;
    describe();
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    Ok(())
}

fn describe() {
    describe_counter!(
        TOKENS_TOTAL,
        metrics::Unit::Count,
        "Tokens processed, by stage and kind (generated, trained)."
    );
    describe_counter!(
        SAMPLES_TOTAL,
        metrics::Unit::Count,
        "Completions processed, by stage."
    );
    describe_counter!(
        SAMPLES_DROPPED_TOTAL,
        metrics::Unit::Count,
        "Groups the trainer dropped, by reason."
    );
    describe_counter!(
        ERRORS_TOTAL,
        metrics::Unit::Count,
        "Errors, by stage and kind."
    );
    describe_gauge!(POLICY_VERSION, "Policy version a stage holds.");
    describe_histogram!(
        SAMPLE_STALENESS_VERSIONS,
        "Versions between a group's oldest token and the trainer."
    );
    describe_histogram!(
        WEIGHT_SWAP_STALL_SECONDS,
        metrics::Unit::Seconds,
        "Decode-loop time to pick up new weights."
    );
    describe_histogram!(
        TRAIN_STEP_SECONDS,
        metrics::Unit::Seconds,
        "Time of one optimizer step."
    );
    describe_gauge!(
        TRAIN_WAIT_SECONDS_TOTAL,
        metrics::Unit::Seconds,
        "Time the trainer waited for data."
    );
    describe_gauge!(REWARD_MEAN, "Mean reward of the last training batch.");
    describe_gauge!(
        IS_ESS,
        "Effective sample size of the importance weights (1 = on-policy)."
    );
    describe_gauge!(CLIP_FRACTION, "Fraction of tokens whose ratio was clipped.");
    describe_gauge!(
        KL,
        "Mismatch KL between behaviour and current policy on sampled tokens."
    );
    describe_gauge!(ENTROPY, "Mean negative log-prob of sampled tokens.");
    describe_gauge!(GRAD_NORM, "Global gradient norm before clipping.");
    describe_gauge!(BUILD_INFO, "Always 1; labels carry the version.");
}

/// A generator published groups.
pub fn generated(samples: u64, tokens: u64) {
    counter!(SAMPLES_TOTAL, "stage" => "gen").increment(samples);
    counter!(TOKENS_TOTAL, "stage" => "gen", "kind" => "generated").increment(tokens);
}

/// A generator picked up new weights.
pub fn swapped(version: u64, stall_s: f64) {
    gauge!(POLICY_VERSION, "stage" => "gen").set(version as f64);
    histogram!(WEIGHT_SWAP_STALL_SECONDS).record(stall_s);
}

/// A scorer scored samples.
pub fn scored(samples: u64) {
    counter!(SAMPLES_TOTAL, "stage" => "score").increment(samples);
}

/// A stage hit an error it survived.
pub fn error(stage: &'static str, kind: &'static str) {
    counter!(ERRORS_TOTAL, "stage" => stage, "kind" => kind).increment(1);
}

/// The trainer dropped a group.
pub fn dropped(reason: &str, samples: u64) {
    counter!(SAMPLES_DROPPED_TOTAL, "stage" => "train", "reason" => reason.to_string())
        .increment(samples);
}

/// The trainer took a step.
pub fn trained(s: &crate::stages::train::StepStats, samples: u64) {
    counter!(SAMPLES_TOTAL, "stage" => "train").increment(samples);
    counter!(TOKENS_TOTAL, "stage" => "train", "kind" => "trained").increment(s.tokens as u64);
    gauge!(POLICY_VERSION, "stage" => "train").set(s.version as f64);
    histogram!(TRAIN_STEP_SECONDS).record(s.step_s);
    // Fractional seconds: a monotonically increasing gauge (metrics counters are integers).
    gauge!(TRAIN_WAIT_SECONDS_TOTAL).increment(s.wait_s);
    for &lag in &s.staleness {
        histogram!(SAMPLE_STALENESS_VERSIONS).record(lag as f64);
    }
    gauge!(REWARD_MEAN).set(s.reward_mean);
    gauge!(IS_ESS).set(s.ess);
    gauge!(CLIP_FRACTION).set(s.clip_fraction);
    gauge!(KL).set(s.mismatch_kl);
    gauge!(ENTROPY).set(s.entropy);
    gauge!(GRAD_NORM).set(s.grad_norm);
}
