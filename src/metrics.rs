//! Telemetry in one place: every metric name, its unit and description, the histogram
//! buckets, and the Prometheus exporter. Stages record through the helpers here so names
//! never drift; `grafana/dashboards/rlstream.json` queries exactly these names (a test scrapes
//! real stages and checks every name the dashboard uses).
//!
//! Naming follows Prometheus: `rlstream_` prefix, base units (seconds, bytes), `_total` for
//! counters. Stream names in labels are full keys (`rl:prompts`), so several namespaces on one
//! Redis stay apart.

use crate::roles::Stage;
use crate::schema::StepRecord;
use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use std::net::SocketAddr;
use std::time::Duration;

pub const TOKENS_TOTAL: &str = "rlstream_tokens_total";
pub const SAMPLES_TOTAL: &str = "rlstream_samples_total";
pub const SAMPLES_DROPPED_TOTAL: &str = "rlstream_samples_dropped_total";
pub const SAMPLES_SHAPED_TOTAL: &str = "rlstream_samples_shaped_total";
pub const SAMPLES_TRUNCATED_TOTAL: &str = "rlstream_samples_truncated_total";
pub const ERRORS_TOTAL: &str = "rlstream_errors_total";
pub const DEAD_LETTERS_TOTAL: &str = "rlstream_dead_letters_total";
pub const EPISODES_TOTAL: &str = "rlstream_episodes_total";
pub const EPISODE_TURNS_TOTAL: &str = "rlstream_episode_turns_total";
pub const ENV_FAILURES_TOTAL: &str = "rlstream_env_failures_total";
pub const ENV_STEP_SECONDS: &str = "rlstream_env_step_seconds";
pub const ENV_STARTS_TOTAL: &str = "rlstream_env_process_starts_total";
pub const CLAIMED_TOTAL: &str = "rlstream_entries_claimed_total";
pub const BUS_DATA_LOSS_TOTAL: &str = "rlstream_bus_data_loss_total";
pub const BUS_LOST_ENTRIES_TOTAL: &str = "rlstream_bus_lost_entries_total";
pub const STREAM_MEMORY_BYTES: &str = "rlstream_stream_memory_bytes";
pub const STREAM_TRIMMED_TOTAL: &str = "rlstream_stream_trimmed_entries_total";
pub const POLICY_VERSION: &str = "rlstream_policy_version";
pub const SAMPLE_STALENESS_VERSIONS: &str = "rlstream_sample_staleness_versions";
pub const WEIGHT_SWAP_STALL_SECONDS: &str = "rlstream_weight_swap_stall_seconds";
pub const WEIGHT_SYNC_SECONDS: &str = "rlstream_weight_sync_seconds";
pub const TRAIN_STEP_SECONDS: &str = "rlstream_train_step_seconds";
pub const WEIGHTS_VERSION_BYTES: &str = "rlstream_weights_version_bytes";
pub const WEIGHTS_PUBLISHED_BYTES_TOTAL: &str = "rlstream_weights_published_bytes_total";
pub const WEIGHTS_ENCODE_SECONDS: &str = "rlstream_weights_encode_seconds";
pub const WEIGHTS_STORE_BYTES: &str = "rlstream_weights_store_bytes";
pub const WEIGHTS_STORE_MAX_BYTES: &str = "rlstream_weights_store_max_bytes";
pub const WEIGHTS_PHASE_SECONDS: &str = "rlstream_weights_phase_seconds";
pub const WEIGHTS_PUBLISH_TO_SWAP_SECONDS: &str = "rlstream_weights_publish_to_swap_seconds";
/// A histogram: its `_sum` is the total wait, so `rate(..._sum)` is the fraction of time
/// the trainer waits for data. (A fractional-seconds `_total` counter is not expressible
/// with integer counters, and a gauge may not carry the `_total` suffix.)
pub const TRAIN_WAIT_SECONDS: &str = "rlstream_train_wait_seconds";
pub const SCORE_SECONDS: &str = "rlstream_score_seconds";
pub const STREAM_LENGTH: &str = "rlstream_stream_length";
pub const STREAM_PENDING: &str = "rlstream_stream_pending";
pub const STREAM_LAG: &str = "rlstream_stream_lag";
pub const STREAM_CONSUMERS: &str = "rlstream_stream_consumers";
pub const REWARD_MEAN: &str = "rlstream_reward_mean";
pub const ACCURACY: &str = "rlstream_accuracy";
pub const LOSS: &str = "rlstream_loss";
pub const IS_ESS: &str = "rlstream_is_ess";
pub const CLIP_FRACTION: &str = "rlstream_clip_fraction";
pub const MASKED_FRACTION: &str = "rlstream_masked_fraction";
pub const KL: &str = "rlstream_kl";
pub const SAMPLED_NLL: &str = "rlstream_sampled_nll";
pub const POLICY_ENTROPY: &str = "rlstream_policy_entropy";
pub const REF_KL: &str = "rlstream_ref_kl";
pub const SEQ_RATIO_STD: &str = "rlstream_seq_ratio_std";
pub const PROX_GAP: &str = "rlstream_prox_gap";
pub const UPDATES_PER_STEP: &str = "rlstream_updates_per_step";
pub const TEACHER_KL: &str = "rlstream_teacher_kl";
pub const ROUTING_MISMATCH: &str = "rlstream_routing_mismatch_fraction";
pub const LOGPROB_GAP: &str = "rlstream_logprob_gap";
pub const SWAP_TOKENS: &str = "rlstream_swap_tokens";
pub const GRAD_NORM: &str = "rlstream_grad_norm";
pub const BUILD_INFO: &str = "rlstream_build_info";
pub const SERVE_REQUESTS_TOTAL: &str = "rlstream_serve_requests_total";
pub const SERVE_REQUEST_SECONDS: &str = "rlstream_serve_request_seconds";
pub const SERVE_ROWS: &str = "rlstream_serve_rows";
pub const SERVE_RECORDED_TOTAL: &str = "rlstream_serve_recorded_calls_total";
pub const SERVE_DRIFT_TOTAL: &str = "rlstream_serve_drift_total";
pub const SERVE_EPISODES_TOTAL: &str = "rlstream_serve_episodes_total";
pub const SERVE_CONNECTIONS_REFUSED_TOTAL: &str = "rlstream_serve_connections_refused_total";
pub const SERVE_EPISODE_CACHE_TOTAL: &str = "rlstream_serve_episode_cache_total";
pub const SERVE_EPISODE_CACHE_BYTES: &str = "rlstream_serve_episode_cache_bytes";
pub const SERVE_EPISODE_CACHE_EVICTIONS_TOTAL: &str =
    "rlstream_serve_episode_cache_evictions_total";

/// The commit the binary was built from (`git rev-parse --short=12 HEAD` at build time, or
/// `RLSTREAM_GIT_SHA`, or `unknown` outside a checkout).
pub const GIT_SHA: &str = env!("RLSTREAM_GIT_SHA");

/// Buckets of the staleness histogram, in versions.
const STALENESS_BUCKETS: &[f64] = &[0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0];
/// Buckets of the swap stall, in seconds: microseconds expected.
const STALL_BUCKETS: &[f64] = &[1e-6, 5e-6, 2e-5, 1e-4, 5e-4, 2e-3, 1e-2, 1e-1];
/// Buckets of a weight publish or fetch-and-build: milliseconds (tiny models) to a minute.
const SYNC_BUCKETS: &[f64] = &[1e-3, 5e-3, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0];
/// Buckets of the train step time and the trainer's wait, in seconds.
const STEP_BUCKETS: &[f64] = &[1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0];
/// Buckets of scoring one group: built-in verifiers take microseconds, external scorers
/// up to seconds.
const SCORE_BUCKETS: &[f64] = &[1e-5, 1e-4, 1e-3, 0.01, 0.1, 1.0, 10.0];
/// Buckets of one environment step: built-in games take microseconds, a process on the
/// same machine about a millisecond, tools and sandboxes up to minutes.
const ENV_STEP_BUCKETS: &[f64] = &[1e-5, 1e-4, 1e-3, 0.01, 0.05, 0.2, 1.0, 5.0, 30.0, 120.0];

/// Buckets of an endpoint request, first byte to last: a few tokens on a tiny model to
/// minutes of decoding.
const REQUEST_BUCKETS: &[f64] = &[
    1e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0, 300.0,
];

/// Every histogram with its buckets (the exporter emits summaries for histograms without).
const HISTOGRAMS: &[(&str, &[f64])] = &[
    (SERVE_REQUEST_SECONDS, REQUEST_BUCKETS),
    (SAMPLE_STALENESS_VERSIONS, STALENESS_BUCKETS),
    (WEIGHT_SWAP_STALL_SECONDS, STALL_BUCKETS),
    (WEIGHT_SYNC_SECONDS, SYNC_BUCKETS),
    (WEIGHTS_ENCODE_SECONDS, SYNC_BUCKETS),
    (WEIGHTS_PHASE_SECONDS, SYNC_BUCKETS),
    (WEIGHTS_PUBLISH_TO_SWAP_SECONDS, SYNC_BUCKETS),
    (TRAIN_STEP_SECONDS, STEP_BUCKETS),
    (TRAIN_WAIT_SECONDS, STEP_BUCKETS),
    (SCORE_SECONDS, SCORE_BUCKETS),
    (ENV_STEP_SECONDS, ENV_STEP_BUCKETS),
];

/// How often stream length, pending and lag are read from XINFO.
pub const STREAM_POLL: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error(
        "--metrics-addr `{0}` is not an address (expected PORT for loopback, or HOST:PORT, e.g. 9101 or 0.0.0.0:9101)"
    )]
    BadAddr(String),
    #[error(
        "cannot serve metrics on {addr}: {reason} (is another process using the port? pick another --metrics-addr)"
    )]
    Install { addr: String, reason: String },
}

/// `PORT` or `:PORT` (loopback), or `HOST:PORT`.
pub fn parse_addr(addr: &str) -> Result<SocketAddr, MetricsError> {
    let bad = || MetricsError::BadAddr(addr.to_string());
    let port_only = addr.strip_prefix(':').unwrap_or(addr);
    if !port_only.is_empty() && port_only.bytes().all(|b| b.is_ascii_digit()) {
        let port: u16 = port_only.parse().map_err(|_| bad())?;
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    addr.parse().map_err(|_| bad())
}

/// Serves `/metrics` on `addr` (needs a tokio runtime) and describes every metric; returns
/// the address served. A bare port binds loopback: the endpoint has no authentication, so
/// bind another interface only for a Prometheus on another machine.
pub fn install(addr: &str) -> Result<SocketAddr, MetricsError> {
    let socket = parse_addr(addr)?;
    let install_err = |reason: String| MetricsError::Install {
        addr: addr.to_string(),
        reason,
    };
    let mut builder = PrometheusBuilder::new().with_http_listener(socket);
    for &(name, buckets) in HISTOGRAMS {
        builder = builder
            .set_buckets_for_metric(Matcher::Full(name.into()), buckets)
            .map_err(|e| install_err(e.to_string()))?;
    }
    builder.install().map_err(|e| install_err(e.to_string()))?;
    describe();
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"), "git_sha" => GIT_SHA).set(1.0);
    Ok(socket)
}

/// Every metric's unit and description: a table, one entry per metric.
#[allow(clippy::too_many_lines)]
fn describe() {
    describe_counter!(
        SAMPLES_SHAPED_TOTAL,
        Unit::Count,
        "Completions whose reward the scorer lowered by length, by kind (overlong: score.overlong_buffer; length: score.length_penalty)."
    );
    describe_counter!(
        SAMPLES_TRUNCATED_TOTAL,
        Unit::Count,
        "Completions cut at max_new_tokens that reached the trainer, by whether train.mask_truncated kept them out of the loss (masked true/false)."
    );
    describe_counter!(
        EPISODES_TOTAL,
        Unit::Count,
        "Episodes the generator finished, by how they ended (done, turns, tokens)."
    );
    describe_counter!(
        EPISODE_TURNS_TOTAL,
        Unit::Count,
        "Model turns of the finished episodes (divide by rlstream_episodes_total for turns per episode)."
    );
    describe_counter!(
        ENV_FAILURES_TOTAL,
        Unit::Count,
        "Episodes ended by their environment failing, by reason (env_error, env_timeout, env_panic, env_observation, env_setup, env_crash, env_protocol); never trained."
    );
    describe_histogram!(
        ENV_STEP_SECONDS,
        Unit::Seconds,
        "Time an environment step took, from the turn handed to it to its answer (answered steps, failed ones included; timed-out ones not)."
    );
    describe_counter!(
        ENV_STARTS_TOTAL,
        Unit::Count,
        "Starts of the external environment process (gen --env-cmd): 1 plus its restarts."
    );
    describe_counter!(
        TOKENS_TOTAL,
        Unit::Count,
        "Tokens processed, by stage and kind (generated, scored, trained)."
    );
    describe_counter!(
        SAMPLES_TOTAL,
        Unit::Count,
        "Prompts fed (stage feed) and completions processed (gen, score, train)."
    );
    describe_counter!(
        SAMPLES_DROPPED_TOTAL,
        Unit::Count,
        "Completions the trainer dropped, by reason (stale, duplicate, empty)."
    );
    describe_counter!(
        ERRORS_TOTAL,
        Unit::Count,
        "Errors a stage survived, by stage and kind."
    );
    describe_counter!(
        DEAD_LETTERS_TOTAL,
        Unit::Count,
        "Entries moved to the dead-letter stream, by source stream, group and reason."
    );
    describe_gauge!(
        STREAM_MEMORY_BYTES,
        Unit::Bytes,
        "Bus memory a stream takes (Redis MEMORY USAGE), by stream, as the standing trim last read it."
    );
    describe_counter!(
        STREAM_TRIMMED_TOTAL,
        Unit::Count,
        "Finished entries the standing trim removed, by stream (archived first with --archive-dir)."
    );
    describe_counter!(
        CLAIMED_TOTAL,
        Unit::Count,
        "Entries claimed from consumers that left them pending too long (crashed or stuck)."
    );
    describe_counter!(
        BUS_DATA_LOSS_TOTAL,
        Unit::Count,
        "Times a consumer found Redis without its data (its group gone, or entries handed out again) and recreated its group."
    );
    describe_counter!(
        BUS_LOST_ENTRIES_TOTAL,
        Unit::Count,
        "Entries a data loss touched, by state: held (in hand, their pending record gone) or replayed (handed out again, dropped)."
    );
    describe_gauge!(POLICY_VERSION, "Policy version a stage holds.");
    describe_histogram!(
        SAMPLE_STALENESS_VERSIONS,
        "Versions between a trained group's oldest token and the trainer."
    );
    describe_histogram!(
        WEIGHT_SWAP_STALL_SECONDS,
        Unit::Seconds,
        "Decode-loop time to pick up new weights between two forward passes."
    );
    describe_histogram!(
        WEIGHT_SYNC_SECONDS,
        Unit::Seconds,
        "Time to move one weight version: publish (stage train) or fetch, verify and build (stage gen)."
    );
    describe_gauge!(
        WEIGHTS_VERSION_BYTES,
        Unit::Bytes,
        "Stored size of the last published weight version, by kind (full, delta, lora: an adapter version)."
    );
    describe_counter!(
        WEIGHTS_PUBLISHED_BYTES_TOTAL,
        Unit::Bytes,
        "Bytes of weight versions written to the store, by kind (full, delta, lora: an adapter version)."
    );
    describe_histogram!(
        WEIGHTS_ENCODE_SECONDS,
        Unit::Seconds,
        "Trainer time to encode a weight version (checksum, delta and zstd)."
    );
    describe_gauge!(
        WEIGHTS_STORE_BYTES,
        Unit::Bytes,
        "Bytes the published weight versions occupy in their store."
    );
    describe_gauge!(
        WEIGHTS_STORE_MAX_BYTES,
        Unit::Bytes,
        "weights.max_bytes, the bound on the store (0: none)."
    );
    describe_histogram!(
        WEIGHTS_PHASE_SECONDS,
        Unit::Seconds,
        "Generator time per phase of taking a weight version (fetch, decode, verify, build)."
    );
    describe_histogram!(
        WEIGHTS_PUBLISH_TO_SWAP_SECONDS,
        Unit::Seconds,
        "From the trainer starting to publish a version to this generator swapping it in."
    );
    describe_histogram!(
        TRAIN_STEP_SECONDS,
        Unit::Seconds,
        "Time of one optimizer step."
    );
    describe_histogram!(
        TRAIN_WAIT_SECONDS,
        Unit::Seconds,
        "Time the trainer waited for data before each step."
    );
    describe_histogram!(SCORE_SECONDS, Unit::Seconds, "Time to score one group.");
    describe_gauge!(STREAM_LENGTH, Unit::Count, "Entries in a stream (XINFO).");
    describe_gauge!(
        STREAM_PENDING,
        Unit::Count,
        "Entries delivered to a consumer group and not yet acked."
    );
    describe_gauge!(
        STREAM_LAG,
        Unit::Count,
        "Entries in a stream not yet delivered to a consumer group."
    );
    describe_gauge!(
        STREAM_CONSUMERS,
        Unit::Count,
        "Consumers registered in a consumer group."
    );
    describe_gauge!(REWARD_MEAN, "Mean reward of the last training batch.");
    describe_gauge!(
        ACCURACY,
        "Fraction of the last training batch's completions with full reward."
    );
    describe_gauge!(LOSS, "Loss of the last training step.");
    describe_gauge!(
        IS_ESS,
        "Effective sample size of the importance weights, normalised (1 = on-policy)."
    );
    describe_gauge!(
        CLIP_FRACTION,
        "Fraction of tokens whose loss the objective's clip changed."
    );
    describe_gauge!(
        MASKED_FRACTION,
        "Fraction of tokens off-policy masking (train.is_mask) dropped from the loss."
    );
    describe_gauge!(
        KL,
        "Mismatch KL between behaviour and current policy on sampled tokens."
    );
    describe_gauge!(
        SAMPLED_NLL,
        "Mean negative log-prob of the last step's sampled tokens under the trainer's policy."
    );
    describe_gauge!(
        POLICY_ENTROPY,
        "Mean entropy of the policy's distribution over the last step's completion tokens."
    );
    describe_gauge!(
        REF_KL,
        "KL to the initial policy in the last step's loss (train.kl_coef > 0), by train.kl_loss_type."
    );
    describe_gauge!(
        SEQ_RATIO_STD,
        "Standard deviation of the sequences' importance ratios in the last step (GSPO's sequence ratio)."
    );
    describe_gauge!(
        PROX_GAP,
        "Decoupled PPO: mean |log pi_prox - log mu| over the last step's tokens."
    );
    describe_gauge!(
        UPDATES_PER_STEP,
        Unit::Count,
        "Optimizer updates the last step took (train.ppo_mini_batch_size, train.ppo_epochs)."
    );
    describe_gauge!(
        TEACHER_KL,
        "KL(student || teacher) on the last step's sampled tokens (mean behaviour minus teacher log-prob), when a teacher scored them."
    );
    describe_gauge!(
        LOGPROB_GAP,
        "Mean |trainer log-prob - behaviour log-prob| over the last step's sampled tokens."
    );
    describe_gauge!(
        SWAP_TOKENS,
        "Sampled tokens of the last step drawn after a weight swap inside their completion (their log-probs match no one version exactly)."
    );
    describe_gauge!(
        ROUTING_MISMATCH,
        "Mixture-of-experts policies: fraction of the last step's recorded (token, MoE layer) routing decisions for which the trainer's live router picks other experts."
    );
    describe_gauge!(GRAD_NORM, "Global gradient norm before clipping.");
    describe_counter!(
        SERVE_REQUESTS_TOTAL,
        Unit::Count,
        "Endpoint requests (gen --serve) by endpoint and outcome (ok, or what refused or ended it)."
    );
    describe_histogram!(
        SERVE_REQUEST_SECONDS,
        Unit::Seconds,
        "Endpoint requests' time from arrival to their last byte, by endpoint."
    );
    describe_gauge!(
        SERVE_ROWS,
        Unit::Count,
        "KV rows the endpoint's calls hold in the generator's batch."
    );
    describe_counter!(
        SERVE_RECORDED_TOTAL,
        Unit::Count,
        "Endpoint calls recorded into an episode (X-Rlstream-Episode)."
    );
    describe_counter!(
        SERVE_CONNECTIONS_REFUSED_TOTAL,
        Unit::Count,
        "Endpoint connections closed as soon as accepted: gen.serve_max_connections were open."
    );
    describe_counter!(
        SERVE_EPISODE_CACHE_TOTAL,
        Unit::Count,
        "Calls of recorded episodes by how their prompt was read: continued (from the episode's kept KV cache) or prefilled (whole)."
    );
    describe_gauge!(
        SERVE_EPISODE_CACHE_BYTES,
        Unit::Bytes,
        "Bytes of the KV caches kept for agent episodes between their calls."
    );
    describe_counter!(
        SERVE_EPISODE_CACHE_EVICTIONS_TOTAL,
        Unit::Count,
        "Episodes' kept KV caches dropped to stay within gen.serve_episode_cache_mb."
    );
    describe_counter!(
        SERVE_DRIFT_TOTAL,
        Unit::Count,
        "Endpoint calls of a trained episode whose prompt did not extend what the episode sampled (its episode is not trained)."
    );
    describe_counter!(
        SERVE_EPISODES_TOTAL,
        Unit::Count,
        "Agent episodes closed through the endpoint, by outcome (closed: trained with its group; drift: left out)."
    );
    describe_gauge!(
        BUILD_INFO,
        "Always 1; the labels carry the version and git commit."
    );
}

/// Errors each stage can count, by kind; see [`started`].
const ERROR_KINDS: &[(Stage, &[&str])] = &[
    (
        Stage::Gen,
        &["bus", "tokenize", "weights_rejected", "weights_unavailable"],
    ),
    (Stage::Score, &["scorer"]),
    (Stage::Train, &["nonfinite_step", "weights_store"]),
];
/// Why the trainer drops groups.
const DROP_REASONS: &[&str] = &["stale", "duplicate", "nonfinite"];

/// A stage started: its error and drop counters start at 0, so `rate()` and the dashboard
/// see the series before the first error (an absent series reads as "no data", not 0).
pub fn started(stage: Stage) {
    for &(s, kinds) in ERROR_KINDS {
        if s == stage {
            for &kind in kinds {
                error_n(stage, kind, 0);
            }
        }
    }
    if stage == Stage::Train {
        for &reason in DROP_REASONS {
            dropped(reason, 0);
        }
    }
}

pub(crate) fn error_n(stage: Stage, kind: &'static str, n: u64) {
    counter!(ERRORS_TOTAL, "stage" => stage.as_str(), "kind" => kind).increment(n);
}

/// The feeder published prompts.
pub fn fed(prompts: u64) {
    counter!(SAMPLES_TOTAL, "stage" => Stage::Feed.as_str()).increment(prompts);
}

/// A generator published groups.
pub fn generated(samples: u64, tokens: u64) {
    counter!(SAMPLES_TOTAL, "stage" => Stage::Gen.as_str()).increment(samples);
    counter!(TOKENS_TOTAL, "stage" => Stage::Gen.as_str(), "kind" => "generated").increment(tokens);
}

/// A generator finished an episode of `turns` model turns, ended as `ended` says.
pub fn episode(ended: &'static str, turns: u32) {
    counter!(EPISODES_TOTAL, "ended" => ended).increment(1);
    counter!(EPISODE_TURNS_TOTAL).increment(u64::from(turns));
}

/// An environment failed an episode.
pub fn env_failed(reason: &'static str) {
    counter!(ENV_FAILURES_TOTAL, "reason" => reason).increment(1);
}

/// An environment answered a step after `seconds`.
pub fn env_step(seconds: f64) {
    histogram!(ENV_STEP_SECONDS).record(seconds);
}

/// The external environment process was started (`n`-th start).
pub fn env_started(n: u64) {
    counter!(ENV_STARTS_TOTAL).increment(1);
    if n > 1 {
        tracing::info!(starts = n, "environment process restarted");
    }
}

/// An endpoint request on `endpoint` ended as `outcome` after `seconds`.
pub fn serve_request(endpoint: &'static str, outcome: &'static str, seconds: f64) {
    counter!(SERVE_REQUESTS_TOTAL, "endpoint" => endpoint, "outcome" => outcome).increment(1);
    histogram!(SERVE_REQUEST_SECONDS, "endpoint" => endpoint).record(seconds);
}

/// The endpoint's calls hold `rows` rows of the generator's batch.
pub fn serving_rows(rows: usize) {
    gauge!(SERVE_ROWS).set(rows as f64);
}

/// An endpoint connection was closed at once: the bound on open connections was reached.
pub fn connection_refused() {
    counter!(SERVE_CONNECTIONS_REFUSED_TOTAL).increment(1);
}

/// `calls` calls of recorded episodes read their prompt as `outcome` (`continued`,
/// `prefilled`).
pub fn episode_cache(outcome: &'static str, calls: u64) {
    counter!(SERVE_EPISODE_CACHE_TOTAL, "outcome" => outcome).increment(calls);
}

/// The episodes' kept caches take `bytes`, after `evicted` were dropped for room.
pub fn episode_caches(bytes: usize, evicted: u64) {
    gauge!(SERVE_EPISODE_CACHE_BYTES).set(bytes as f64);
    if evicted > 0 {
        counter!(SERVE_EPISODE_CACHE_EVICTIONS_TOTAL).increment(evicted);
    }
}

/// A call of a trained episode did not extend what its episode sampled.
pub fn drift() {
    counter!(SERVE_DRIFT_TOTAL).increment(1);
}

/// An agent episode was closed (`outcome`: `closed` or `drift`).
pub fn agent_episode(outcome: &'static str) {
    counter!(SERVE_EPISODES_TOTAL, "outcome" => outcome).increment(1);
}

/// A call was recorded into an episode.
pub fn recorded_call() {
    counter!(SERVE_RECORDED_TOTAL).increment(1);
}

/// A generator picked up new weights.
pub fn swapped(version: u64, stall_s: f64) {
    gauge!(POLICY_VERSION, "stage" => Stage::Gen.as_str()).set(version as f64);
    histogram!(WEIGHT_SWAP_STALL_SECONDS).record(stall_s);
}

/// A stage holds `version` (at start, before any swap or step).
pub fn holds(stage: Stage, version: u64) {
    gauge!(POLICY_VERSION, "stage" => stage.as_str()).set(version as f64);
}

/// One weight version moved: published by the trainer or fetched and built by a generator.
pub fn weight_sync(stage: Stage, seconds: f64) {
    histogram!(WEIGHT_SYNC_SECONDS, "stage" => stage.as_str()).record(seconds);
}

/// The trainer wrote a weight version of `bytes` (a delta or a whole version) after
/// `encode_s` of encoding.
pub fn weights_published(kind: &'static str, bytes: u64, encode_s: f64) {
    gauge!(WEIGHTS_VERSION_BYTES, "kind" => kind).set(bytes as f64);
    counter!(WEIGHTS_PUBLISHED_BYTES_TOTAL, "kind" => kind).increment(bytes);
    histogram!(WEIGHTS_ENCODE_SECONDS).record(encode_s);
}

/// What the weight store holds, and its bound.
pub fn weights_store(bytes: u64, max_bytes: u64) {
    gauge!(WEIGHTS_STORE_BYTES).set(bytes as f64);
    gauge!(WEIGHTS_STORE_MAX_BYTES).set(max_bytes as f64);
}

/// A generator spent `seconds` in one phase of taking a version.
pub fn weight_phase(phase: &'static str, seconds: f64) {
    histogram!(WEIGHTS_PHASE_SECONDS, "phase" => phase).record(seconds);
}

/// A generator swapped in a version `seconds` after the trainer began publishing it.
pub fn publish_to_swap(seconds: f64) {
    histogram!(WEIGHTS_PUBLISH_TO_SWAP_SECONDS).record(seconds);
}

/// A scorer scored one group.
pub fn scored(samples: u64, tokens: u64, seconds: f64) {
    counter!(SAMPLES_TOTAL, "stage" => Stage::Score.as_str()).increment(samples);
    counter!(TOKENS_TOTAL, "stage" => Stage::Score.as_str(), "kind" => "scored").increment(tokens);
    histogram!(SCORE_SECONDS).record(seconds);
}

/// The scorer lowered `overlong` rewards by the overlong penalty and `length` by the
/// length penalty.
pub fn shaped(overlong: u64, length: u64) {
    for (kind, n) in [("overlong", overlong), ("length", length)] {
        if n > 0 {
            counter!(SAMPLES_SHAPED_TOTAL, "kind" => kind).increment(n);
        }
    }
}

/// A stage hit an error it survived.
pub fn error(stage: Stage, kind: &'static str) {
    error_n(stage, kind, 1);
}

/// A consumer moved entries to the dead-letter stream.
pub fn dead_lettered(stream: &str, group: &str, reason: &str, n: u64) {
    counter!(DEAD_LETTERS_TOTAL, "stream" => stream.to_string(), "group" => group.to_string(),
        "reason" => reason.to_string())
    .increment(n);
}

/// A consumer found Redis without its data and went on.
pub fn data_loss(stream: &str, group: &str) {
    counter!(BUS_DATA_LOSS_TOTAL, "stream" => stream.to_string(), "group" => group.to_string())
        .increment(1);
}

/// Entries a data loss touched: `held` (in hand) or `replayed` (handed out again, dropped).
pub fn lost_entries(stream: &str, group: &str, state: &'static str, n: u64) {
    counter!(BUS_LOST_ENTRIES_TOTAL, "stream" => stream.to_string(),
        "group" => group.to_string(), "state" => state)
    .increment(n);
}

/// The standing trim read a stream's memory (`stream` is the full key).
pub fn stream_bytes(stream: &str, bytes: u64) {
    gauge!(STREAM_MEMORY_BYTES, "stream" => stream.to_string()).set(bytes as f64);
}

/// The standing trim removed `n` finished entries of a stream (`stream` is the full key).
pub fn trimmed(stream: &str, n: u64) {
    counter!(STREAM_TRIMMED_TOTAL, "stream" => stream.to_string()).increment(n);
}

/// A consumer claimed entries another consumer left pending.
pub fn claimed(stream: &str, group: &str, n: u64) {
    counter!(CLAIMED_TOTAL, "stream" => stream.to_string(), "group" => group.to_string())
        .increment(n);
}

/// The trainer dropped a group.
pub fn dropped(reason: &str, samples: u64) {
    counter!(SAMPLES_DROPPED_TOTAL, "stage" => Stage::Train.as_str(), "reason" => reason.to_string())
        .increment(samples);
}

/// The trainer took a step (or skipped one: `s.skipped`) on `samples` samples.
pub fn trained(s: &StepRecord, samples: u64) {
    histogram!(TRAIN_WAIT_SECONDS).record(s.wait_s);
    histogram!(TRAIN_STEP_SECONDS).record(s.step_s);
    if s.skipped {
        error(Stage::Train, "nonfinite_step");
        return;
    }
    counter!(SAMPLES_TOTAL, "stage" => Stage::Train.as_str()).increment(samples);
    counter!(TOKENS_TOTAL, "stage" => Stage::Train.as_str(), "kind" => "trained")
        .increment(s.tokens);
    gauge!(POLICY_VERSION, "stage" => Stage::Train.as_str()).set(s.version as f64);
    for &lag in &s.staleness {
        histogram!(SAMPLE_STALENESS_VERSIONS).record(lag as f64);
    }
    gauge!(REWARD_MEAN).set(s.reward_mean);
    gauge!(ACCURACY).set(s.accuracy);
    gauge!(LOSS).set(s.loss);
    gauge!(IS_ESS).set(s.ess);
    gauge!(CLIP_FRACTION).set(s.clip_fraction);
    gauge!(MASKED_FRACTION).set(s.masked_fraction);
    gauge!(KL).set(s.mismatch_kl);
    gauge!(SAMPLED_NLL).set(s.sampled_nll);
    gauge!(POLICY_ENTROPY).set(s.policy_entropy);
    gauge!(REF_KL).set(s.ref_kl);
    gauge!(SEQ_RATIO_STD).set(s.seq_ratio_std);
    gauge!(PROX_GAP).set(s.prox_gap);
    gauge!(UPDATES_PER_STEP).set(s.updates as f64);
    let kept = s.truncated_samples.saturating_sub(s.masked_samples);
    for (masked, n) in [("true", s.masked_samples), ("false", kept)] {
        if n > 0 {
            counter!(SAMPLES_TRUNCATED_TOTAL, "masked" => masked).increment(n);
        }
    }
    if let Some(kl) = s.teacher_kl {
        gauge!(TEACHER_KL).set(kl);
    }
    gauge!(LOGPROB_GAP).set(s.logprob_gap);
    gauge!(SWAP_TOKENS).set(s.swap_tokens as f64);
    if let Some(m) = s.routing_mismatch {
        gauge!(ROUTING_MISMATCH).set(m);
    }
    gauge!(GRAD_NORM).set(s.grad_norm);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_port_binds_loopback() {
        let addr = |s: &str| parse_addr(s).map(|a| a.to_string());
        assert_eq!(addr("9101").ok().as_deref(), Some("127.0.0.1:9101"));
        assert_eq!(addr(":9101").ok().as_deref(), Some("127.0.0.1:9101"));
        assert_eq!(addr("0.0.0.0:9101").ok().as_deref(), Some("0.0.0.0:9101"));
        assert_eq!(addr("[::1]:9101").ok().as_deref(), Some("[::1]:9101"));
        for bad in ["", "99999", "localhost", "host:port"] {
            let e = parse_addr(bad).expect_err(bad).to_string();
            assert!(e.contains("expected PORT"), "{e}");
        }
    }
}
