//! How a version travels from the trainer to the generators (a store, or host tensors in
//! one process) and what the trainer hands over: a blob, host tensors or an adapter.

use super::{WeightsConfig, WeightsError};
use crate::model::layers::Target;
use crate::model::lora::LoraSpec;
use crate::model::tensors::TensorMap;
use crate::schema::AdapterInfo;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// How weights travel from the trainer to the generators.
#[derive(Clone, Default)]
pub enum Transport {
    /// Serialized, checksummed versions in Redis chunks with the default `[weights]`
    /// settings (works across processes and machines).
    #[default]
    Bus,
    /// Serialized, checksummed versions in the store these settings name.
    Store(WeightsConfig),
    /// Host tensors shared in memory; trainer and generators must be in one process.
    InProcess(LocalWeights),
}

/// The versions a trainer handed over in process, newest `keep` kept.
#[derive(Clone, Default)]
pub struct LocalWeights(Arc<Mutex<BTreeMap<u64, Arc<TensorMap>>>>);

impl LocalWeights {
    pub(crate) fn put(&self, version: u64, tensors: Arc<TensorMap>, keep: usize) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.insert(version, tensors);
        while m.len() > keep {
            m.pop_first();
        }
    }

    pub(crate) fn get(&self, version: u64) -> Option<Arc<TensorMap>> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&version)
            .cloned()
    }
}

/// What the trainer hands to [`Publisher::publish_payload`]: host tensors (encoded in the
/// publisher's dtype, or handed over in process), or an encoded whole version.
pub enum Payload {
    Blob(Vec<u8>),
    Tensors(TensorMap),
    /// A LoRA trainer's version: the whole adapter.
    Adapter(AdapterVersion),
}

/// An adapter version: its tensors (PEFT names and layout), shape, and the base it applies
/// to.
pub struct AdapterVersion {
    pub tensors: TensorMap,
    pub spec: LoraSpec,
    /// [`Policy::base_checksum`] of the trainer's frozen base.
    pub base_checksum: String,
}

impl AdapterVersion {
    pub(crate) fn info(&self) -> AdapterInfo {
        AdapterInfo {
            rank: self.spec.rank as u32,
            alpha: self.spec.alpha,
            targets: self
                .spec
                .targets
                .iter()
                .map(|t| t.module().to_string())
                .collect(),
            base_checksum: self.base_checksum.clone(),
        }
    }
}

/// The adapter an announce describes (dropout 0: generators do not train).
pub(crate) fn announced_spec(version: u64, info: &AdapterInfo) -> Result<LoraSpec, WeightsError> {
    let spec = LoraSpec {
        rank: info.rank as usize,
        alpha: info.alpha,
        dropout: 0.0,
        targets: Target::parse_list(&info.targets.join(",")).map_err(|reason| {
            WeightsError::Format {
                version,
                format: format!("adapter targets: {reason}"),
            }
        })?,
    };
    spec.validate().map_err(|reason| WeightsError::Format {
        version,
        format: format!("adapter: {reason}"),
    })?;
    Ok(spec)
}
