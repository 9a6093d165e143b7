//! The KV caches of the endpoint's recorded episodes, kept between their calls: a call that
//! extends its episode continues from the cache its previous call left
//! ([`crate::model::sampler::Generator::admit_continued`]) instead of prefilling the whole
//! history. Bounded by bytes (`gen.serve_episode_cache_mb`, least recently used dropped
//! first), freed when the endpoint says the episode closed, and dropped once idle longer
//! than an episode can stay open.

use crate::model::InferBackend;
use crate::model::sampler::KeptCache;
use std::collections::HashMap;
use std::time::{Duration, Instant};

struct Entry {
    kept: KeptCache<InferBackend>,
    bytes: usize,
    used: Instant,
}

/// Episode id to its kept cache.
pub struct EpisodeCaches {
    entries: HashMap<String, Entry>,
    bytes: usize,
    budget: usize,
    idle: Duration,
}

impl EpisodeCaches {
    /// At most `budget` bytes (0 keeps nothing), each dropped after `idle` unused.
    pub fn new(budget: usize, idle: Duration) -> Self {
        EpisodeCaches {
            entries: HashMap::new(),
            bytes: 0,
            budget,
            idle,
        }
    }

    /// Whether caches are kept at all.
    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// Whether `episode` has a kept cache.
    pub fn holds(&self, episode: &str) -> bool {
        self.entries.contains_key(episode)
    }

    /// Keeps `kept` as `episode`'s cache (replacing the one it had), dropping the least
    /// recently used others past the budget; a cache larger than the whole budget is not
    /// kept.
    pub fn insert(&mut self, episode: String, kept: KeptCache<InferBackend>) {
        self.forget(&episode);
        let bytes = kept.bytes();
        let mut evicted = 0;
        if bytes > self.budget {
            evicted += 1;
        } else {
            while self.bytes + bytes > self.budget {
                let Some(oldest) = self
                    .entries
                    .iter()
                    .min_by_key(|(_, e)| e.used)
                    .map(|(k, _)| k.clone())
                else {
                    break;
                };
                self.forget(&oldest);
                evicted += 1;
            }
            self.bytes += bytes;
            let used = Instant::now();
            self.entries.insert(episode, Entry { kept, bytes, used });
        }
        crate::metrics::episode_caches(self.bytes, evicted);
    }

    /// Takes `episode`'s cache out (its call continues it, and leaves the next one).
    pub fn take(&mut self, episode: &str) -> Option<KeptCache<InferBackend>> {
        let e = self.entries.remove(episode)?;
        self.bytes -= e.bytes;
        crate::metrics::episode_caches(self.bytes, 0);
        Some(e.kept)
    }

    /// Frees `episode`'s cache, if it has one.
    pub fn forget(&mut self, episode: &str) {
        self.take(episode);
    }

    /// Frees the caches unused for longer than an episode can stay open.
    pub fn sweep(&mut self) {
        let idle = self.idle;
        let old: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| e.used.elapsed() >= idle)
            .map(|(k, _)| k.clone())
            .collect();
        for k in old {
            self.forget(&k);
        }
    }
}
