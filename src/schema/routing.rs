//! Routing replay ("Keep Routing"): the experts a mixture-of-experts policy's router chose
//! for each token at sampling time, so that the trainer can run the same experts.
//!
//! A [`Routing`] holds, for a run of tokens, each token's `k` expert ids in each of the
//! model's `layers` MoE layers, dense in `[tokens, layers, k]` order (the ids of one token
//! and layer in the router's order, most probable first). An id takes one byte when the
//! model has at most 256 experts per layer, else two (little-endian): 128 experts, top-8,
//! 48 MoE layers cost 384 bytes per token.

use super::CodecError;
use serde::{Deserialize, Serialize};

/// What routing data is shaped like: MoE layers, experts per token, experts per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutingShape {
    pub layers: u32,
    pub k: u32,
    pub experts: u32,
}

impl RoutingShape {
    /// Bytes per id: 1 up to 256 experts, else 2.
    pub fn width(&self) -> usize {
        if self.experts <= 256 { 1 } else { 2 }
    }

    /// Ids per token (`layers × k`).
    pub fn per_token(&self) -> usize {
        self.layers as usize * self.k as usize
    }
}

impl std::fmt::Display for RoutingShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} MoE layers, top-{} of {} experts",
            self.layers, self.k, self.experts
        )
    }
}

/// Expert ids of a run of tokens, `[tokens, layers, k]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Routing {
    pub layers: u32,
    pub k: u32,
    /// Experts per layer: every id is below it, and it sets the id width.
    pub experts: u32,
    /// The ids, one byte each (`experts` ≤ 256) or two little-endian bytes.
    #[serde(with = "serde_bytes")]
    pub ids: Vec<u8>,
}

impl Routing {
    /// Packs `ids` (`[tokens, layers, k]`, each below `shape.experts`).
    pub fn pack(shape: RoutingShape, ids: &[u16]) -> Routing {
        let bytes = if shape.width() == 1 {
            ids.iter().map(|&i| i as u8).collect()
        } else {
            ids.iter().flat_map(|i| i.to_le_bytes()).collect()
        };
        Routing {
            layers: shape.layers,
            k: shape.k,
            experts: shape.experts,
            ids: bytes,
        }
    }

    pub fn shape(&self) -> RoutingShape {
        RoutingShape {
            layers: self.layers,
            k: self.k,
            experts: self.experts,
        }
    }

    /// Tokens covered (0 for a malformed shape; [`Routing::validate`] reports it).
    pub fn tokens(&self) -> usize {
        let per = self.shape().per_token() * self.shape().width();
        self.ids.len().checked_div(per).unwrap_or(0)
    }

    /// Every id in order, widened.
    pub fn unpack(&self) -> Vec<u16> {
        if self.shape().width() == 1 {
            self.ids.iter().map(|&b| u16::from(b)).collect()
        } else {
            self.ids
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        }
    }

    /// Checks the shape, the length for `tokens` tokens, that every id is below
    /// `experts`, and that no token names an expert twice in one layer.
    pub(crate) fn validate(
        &self,
        kind: &'static str,
        field: &str,
        tokens: usize,
    ) -> Result<(), CodecError> {
        let shape = self.shape();
        if shape.layers == 0 || shape.k == 0 || shape.k > shape.experts || shape.experts > 65_536 {
            return Err(CodecError::invalid(
                kind,
                field,
                format!(
                    "layers {} and k {} must be at least 1, k at most experts {}, experts at \
                     most 65536",
                    shape.layers, shape.k, shape.experts
                ),
            ));
        }
        let want = tokens * shape.per_token() * shape.width();
        if self.ids.len() != want {
            return Err(CodecError::length(
                kind,
                format!("{field}.ids"),
                want,
                self.ids.len(),
            ));
        }
        let k = shape.k as usize;
        for (c, chosen) in self.unpack().chunks_exact(k).enumerate() {
            let (t, layer) = (c / shape.layers as usize, c % shape.layers as usize);
            let at = || format!("{field}.ids[token {t}, layer {layer}]");
            if let Some(&id) = chosen.iter().find(|&&id| u32::from(id) >= shape.experts) {
                return Err(CodecError::invalid(
                    kind,
                    at(),
                    format!("expert {id} is not below experts {}", shape.experts),
                ));
            }
            for (j, id) in chosen.iter().enumerate() {
                if chosen[..j].contains(id) {
                    return Err(CodecError::invalid(
                        kind,
                        at(),
                        format!("expert {id} is chosen twice"),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_pack_in_one_byte_up_to_256_experts_and_two_past_it() {
        let small = RoutingShape {
            layers: 2,
            k: 2,
            experts: 256,
        };
        let ids = [0u16, 255, 3, 4, 7, 1, 2, 9];
        let r = Routing::pack(small, &ids);
        assert_eq!((r.ids.len(), r.tokens()), (8, 2));
        assert_eq!(r.unpack(), ids);
        assert!(r.validate("RolloutGroup", "routing", 2).is_ok());
        let big = RoutingShape {
            experts: 300,
            ..small
        };
        let ids = [299u16, 256, 3, 4];
        let r = Routing::pack(big, &ids);
        assert_eq!((r.ids.len(), r.tokens()), (8, 1));
        assert_eq!(r.unpack(), ids);
        assert!(r.validate("RolloutGroup", "routing", 1).is_ok());
    }

    #[test]
    fn bad_routing_is_refused_by_field() {
        let shape = RoutingShape {
            layers: 2,
            k: 2,
            experts: 8,
        };
        let r = Routing::pack(shape, &[0, 1, 2, 3, 4, 5, 6, 7]);
        let err = |r: &Routing, tokens| {
            r.validate("RolloutGroup", "samples[0].routing", tokens)
                .expect_err("refused")
                .to_string()
        };
        assert!(err(&r, 3).contains("samples[0].routing.ids"));
        let out_of_range = Routing::pack(shape, &[0, 1, 2, 3, 4, 8, 6, 7]);
        let e = err(&out_of_range, 2);
        assert!(
            e.contains("token 1, layer 0") && e.contains("expert 8"),
            "{e}"
        );
        let twice = Routing::pack(shape, &[0, 1, 2, 2, 4, 5, 6, 7]);
        assert!(err(&twice, 2).contains("chosen twice"));
        let wide_k = Routing { k: 9, ..r.clone() };
        assert!(err(&wide_k, 2).contains("k 9"));
    }
}
