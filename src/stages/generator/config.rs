//! The `[gen]` settings.

use serde::{Deserialize, Serialize};

/// What gen does with a prompt that leaves less room than `max_new_tokens` in the model's
/// context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TruncatePrompt {
    /// Keep the prompt whole: generate until the context is full (finish `length`); a
    /// prompt at or over the context is dead-lettered.
    None,
    /// Drop the prompt's first tokens so that `max_new_tokens` fit (at least one token is
    /// kept); the group carries the prompt as generated from.
    Left,
}
crate::enum_setting!(TruncatePrompt);

crate::settings! {
    /// The `[gen]` section (`gen` is reserved in Rust 2024, hence the type's name).
    pub struct GenConfig, flags GenArgs, section "gen" {
        /// Completions per prompt (G).
        pub group_size: usize = 8,
        /// Most tokens per completion (per model turn of an episode).
        pub max_new_tokens: u32 = 16,
        /// Episodes: most model turns; the environment judges the last, then the episode ends (finish `length`).
        pub max_turns: u32 = 8,
        /// Episodes: most tokens after the prompt, model and environment together; 0 = what the context leaves.
        pub max_episode_tokens: u32 = 0,
        /// Episodes: an environment step that takes longer ends its episode (reason `env_timeout`, never trained).
        pub env_timeout_ms: u64 = 10_000,
        /// Episodes: delay added before every environment step, to stand in for a slow environment (benchmarks, tests).
        pub env_latency_ms: u64 = 0,
        /// Episodes: an environment process speaking JSON lines (reset/step by episode_id, see docs/episodes.md) that plays every episode prompt; run without a shell. Unset: the built-in environments.
        #[arg(value_name = "CMD")]
        pub env_cmd: Option<String> = None,
        /// Keep the k most likely tokens when sampling; 0 disables.
        pub top_k: u32 = 0,
        /// Keep the smallest set of tokens with this much probability; 1 disables.
        pub top_p: f32 = 1.0,
        /// When top-k/top-p truncate, most ids a kept set may hold: sampling keeps at most this many of the most likely (an extra top-k), so each token's recorded mask stays small and exact; 0 = no cap.
        pub mask_cap: u32 = 512,
        /// Most sequences decoded together.
        pub max_batch: usize = 64,
        /// A prompt too long for the context and max_new_tokens: keep it whole (`none`) or cut its start (`left`).
        pub truncate_prompt: TruncatePrompt = TruncatePrompt::None,
        /// A PEFT adapter directory applied to --model before the first version arrives (adapter versions from a LoRA trainer replace it).
        #[arg(value_name = "DIR")]
        pub adapter: Option<std::path::PathBuf> = None,
        /// Consumer name, unique per generator process.
        pub name: String = "gen-0".into(),
        /// Serve an OpenAI-compatible endpoint on this address (PORT for loopback, or HOST:PORT) from this generator's decoder; unset: no endpoint.
        #[arg(value_name = "ADDR")]
        pub serve: Option<String> = None,
        /// The endpoint's bearer key, read from this file (or from RLSTREAM_SERVE_KEY); required when --serve binds beyond loopback.
        #[arg(value_name = "FILE")]
        pub serve_key_file: Option<std::path::PathBuf> = None,
        /// Most endpoint requests at once (decoding or waiting for rows); more get 429.
        pub serve_max_requests: usize = 64,
        /// Recorded episodes idle this long (no call) are forgotten (episodes of an open group stay until the group ends).
        pub serve_episode_ttl_s: u64 = 3600,
        /// A group of agent episodes (X-Rlstream-Group) not closed this long after its first call is dead-lettered (reason group_timeout).
        pub serve_group_timeout_s: u64 = 1800,
        /// Largest request body the endpoint reads, in bytes; a larger one gets 413 (request_too_large), unread when its Content-Length says so.
        #[arg(value_name = "BYTES")]
        pub serve_max_body_bytes: usize = 4 << 20,
        /// Seconds a client has to send a request's headers, and as long again for its body (408 request_timeout); a keep-alive connection idle this long between requests is closed.
        #[arg(value_name = "SECS")]
        pub serve_read_timeout_s: u64 = 30,
        /// MiB of KV caches kept for recorded episodes between their calls, so a call that extends its episode prefills only its new tokens (least recently used dropped first, rlstream_serve_episode_cache_evictions_total); 0: every call prefills its episode whole.
        #[arg(value_name = "MIB")]
        pub serve_episode_cache_mb: usize = 1024,
        /// Most connections open on the endpoint at once; one past it is closed as soon as it is accepted (rlstream_serve_connections_refused_total).
        pub serve_max_connections: usize = 1024,
    }
}

/// The top-k to sample with: `top_k` tightened to `mask_cap` whenever sampling truncates
/// at all (top-k or top-p), since every truncated step records its kept set. Without
/// truncation nothing is recorded and nothing is capped.
pub fn capped_top_k(top_k: u32, top_p: f32, mask_cap: u32) -> u32 {
    let truncates = top_k > 0 || top_p < 1.0;
    match (truncates, mask_cap) {
        (false, _) | (true, 0) => top_k,
        (true, cap) if top_k == 0 => cap,
        (true, cap) => top_k.min(cap),
    }
}

impl GenConfig {
    /// The top-k sampling runs with: `top_k` tightened to `mask_cap` whenever sampling
    /// truncates at all (top-k or top-p), since every truncated step records its kept set.
    /// Without truncation nothing is recorded and nothing is capped.
    pub fn sampling_top_k(&self) -> u32 {
        capped_top_k(self.top_k, self.top_p, self.mask_cap)
    }

    /// Checks values the types cannot.
    pub fn validate(&self) -> Result<(), crate::settings::InvalidSetting> {
        use crate::settings::invalid;
        let positive: [(&str, u64); 4] = [
            ("gen.group_size", self.group_size as u64),
            ("gen.max_new_tokens", u64::from(self.max_new_tokens)),
            ("gen.max_turns", u64::from(self.max_turns)),
            ("gen.env_timeout_ms", self.env_timeout_ms),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(invalid(key, "must be at least 1"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("gen.top_p", "must be in (0, 1]"));
        }
        if let Some(addr) = &self.serve {
            crate::metrics::parse_addr(addr).map_err(|e| {
                invalid(
                    "gen.serve",
                    e.to_string().replace("--metrics-addr", "--serve"),
                )
            })?;
        }
        let serve: [(&str, u64); 6] = [
            ("gen.serve_max_requests", self.serve_max_requests as u64),
            ("gen.serve_group_timeout_s", self.serve_group_timeout_s),
            ("gen.serve_episode_ttl_s", self.serve_episode_ttl_s),
            ("gen.serve_max_body_bytes", self.serve_max_body_bytes as u64),
            ("gen.serve_read_timeout_s", self.serve_read_timeout_s),
            (
                "gen.serve_max_connections",
                self.serve_max_connections as u64,
            ),
        ];
        if let Some((key, _)) = serve.iter().find(|(_, v)| *v == 0) {
            return Err(invalid(key, "must be at least 1"));
        }
        if self.max_batch < self.group_size {
            return Err(invalid(
                "gen.max_batch",
                format!("must be at least gen.group_size ({})", self.group_size),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_cap_tightens_top_k_only_when_sampling_truncates() {
        let cfg = |top_k, top_p, mask_cap| GenConfig {
            top_k,
            top_p,
            mask_cap,
            ..GenConfig::default()
        };
        // Full-vocabulary sampling records no mask: nothing to cap.
        assert_eq!(cfg(0, 1.0, 512).sampling_top_k(), 0);
        // Top-p alone: at most the cap's most likely ids.
        assert_eq!(cfg(0, 0.95, 512).sampling_top_k(), 512);
        assert_eq!(cfg(50, 0.95, 512).sampling_top_k(), 50);
        assert_eq!(cfg(1000, 1.0, 512).sampling_top_k(), 512);
        // No cap.
        assert_eq!(cfg(0, 0.95, 0).sampling_top_k(), 0);
    }
}
