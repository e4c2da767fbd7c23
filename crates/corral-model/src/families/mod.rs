//! Model families, one file each, reading top-down like the reference modeling files; the
//! trait each implements ([`FamilyModel`]) and the registry that names them ([`FAMILIES`]):
//! a new family is a file and an entry, nothing else in the model matches on families.

pub(crate) mod qwen3;
pub(crate) mod qwen3_next;

use corral_backend::{Backend, DType, DispatchStats};

use crate::batch::RaggedBatch;
use crate::kv_cache::{PagedKvCache, RecurrentStateCache};
use crate::layers::Workspace;
use crate::moe::{MoeStrategy, SparseMoe};
use crate::weights::WeightSource;
use crate::{Family, ModelConfig, ModelError, Result};

/// What one forward pass works with: the batch, its caches and the workspace its metadata
/// was uploaded to.
pub(crate) struct StepCtx<'a> {
    pub(crate) backend: &'a dyn Backend,
    pub(crate) batch: &'a RaggedBatch,
    pub(crate) cache: &'a mut PagedKvCache,
    /// The recurrent-state cache, for families that keep state.
    pub(crate) state: Option<&'a mut RecurrentStateCache>,
    pub(crate) ws: &'a mut Workspace,
    pub(crate) strategy: MoeStrategy,
    /// The MoE blocks' share of the step's dispatches.
    pub(crate) moe_stats: &'a mut DispatchStats,
    /// `[tokens, hidden]`: the model's final hidden states, for an MTP head.
    pub(crate) hidden: Option<&'a corral_backend::DeviceBuffer>,
}

/// A loaded model of one family: its layers' weights on a backend and its forward pass.
pub(crate) trait FamilyModel: std::fmt::Debug + Send + Sync {
    /// The configuration it was loaded with.
    fn config(&self) -> &ModelConfig;
    /// The element type of its matrices.
    fn weight_dtype(&self) -> DType;
    /// Its sparse MoE blocks, in layer order.
    fn moe_blocks(&self) -> Vec<&SparseMoe>;
    /// Whether it keeps recurrent state (every run of a step then needs a state slot).
    fn recurrent(&self) -> bool;
    /// Stores its LM head again as Q8_0 (`OutputHead::store_as_q8_0`); false where it does not.
    fn lm_head_to_q8_0(&mut self, backend: &dyn Backend) -> Result<bool> {
        let _ = backend;
        Ok(false)
    }
    /// Runs the layers over the step's batch, writing `[logit rows, vocab]` into
    /// `ws.logits`.
    fn forward(&self, step: StepCtx<'_>) -> Result<()>;
}

/// Loads a family's weights from a source.
type Loader = fn(
    &dyn WeightSource,
    &dyn Backend,
    ModelConfig,
    &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn FamilyModel>>;

/// One family as checkpoints name it.
pub(crate) struct FamilyEntry {
    pub(crate) family: Family,
    /// `model_type` values of its `config.json` (the first is its own name).
    pub(crate) model_types: &'static [&'static str],
    /// The `general.architecture` of its GGUF files, and the `model_type` that file's
    /// metadata stands for.
    pub(crate) gguf: (&'static str, &'static str),
    load: Loader,
}

fn load_qwen3(
    source: &dyn WeightSource,
    backend: &dyn Backend,
    config: ModelConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn FamilyModel>> {
    Ok(Box::new(qwen3::Qwen3Model::load(
        source, backend, config, progress,
    )?))
}

fn load_hybrid(
    source: &dyn WeightSource,
    backend: &dyn Backend,
    config: ModelConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn FamilyModel>> {
    Ok(Box::new(qwen3_next::HybridModel::load(
        source, backend, config, progress,
    )?))
}

/// Every family Corral runs.
pub(crate) const FAMILIES: &[FamilyEntry] = &[
    FamilyEntry {
        family: Family::Qwen3Moe,
        model_types: &["qwen3_moe"],
        gguf: ("qwen3moe", "qwen3_moe"),
        load: load_qwen3,
    },
    FamilyEntry {
        family: Family::Qwen3,
        model_types: &["qwen3"],
        gguf: ("qwen3", "qwen3"),
        load: load_qwen3,
    },
    FamilyEntry {
        family: Family::Qwen3Next,
        model_types: &["qwen3_next"],
        gguf: ("qwen3next", "qwen3_next"),
        load: load_hybrid,
    },
    FamilyEntry {
        family: Family::Qwen35Moe,
        model_types: &["qwen3_5_moe", "qwen3_5_moe_text"],
        gguf: ("qwen35moe", "qwen3_5_moe_text"),
        load: load_hybrid,
    },
    FamilyEntry {
        family: Family::Qwen35,
        model_types: &["qwen3_5", "qwen3_5_text"],
        gguf: ("qwen35", "qwen3_5_text"),
        load: load_hybrid,
    },
];

/// The family a `config.json` `model_type` names.
pub(crate) fn by_model_type(model_type: &str) -> Option<&'static FamilyEntry> {
    FAMILIES
        .iter()
        .find(|f| f.model_types.contains(&model_type))
}

/// The family a GGUF `general.architecture` names.
pub(crate) fn by_gguf_architecture(arch: &str) -> Option<&'static FamilyEntry> {
    FAMILIES.iter().find(|f| f.gguf.0 == arch)
}

/// Names for an error: each family's own `model_type`, or GGUF architecture.
pub(crate) fn supported(gguf: bool) -> String {
    FAMILIES
        .iter()
        .map(|f| if gguf { f.gguf.0 } else { f.model_types[0] })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Loads the MTP head of a model of `config` (a hybrid family's `mtp.*` tensors) from
/// `source` onto `backend`.
pub(crate) fn load_mtp(
    source: &dyn WeightSource,
    backend: &dyn Backend,
    config: &ModelConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn FamilyModel>> {
    Ok(Box::new(qwen3_next::HybridModel::load_mtp(
        source, backend, config, progress,
    )?))
}

/// Loads `config`'s family from `source` onto `backend`.
pub(crate) fn load(
    source: &dyn WeightSource,
    backend: &dyn Backend,
    config: ModelConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Box<dyn FamilyModel>> {
    let entry = FAMILIES
        .iter()
        .find(|f| f.family == config.family)
        .ok_or_else(|| ModelError::Unsupported(format!("{:?}", config.family)))?;
    (entry.load)(source, backend, config, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family is in the registry once, found by each of its names.
    #[test]
    fn every_family_is_found_by_its_names() {
        for f in FAMILIES {
            assert_eq!(FAMILIES.iter().filter(|e| e.family == f.family).count(), 1);
            assert_eq!(f.family.model_type(), f.model_types[0]);
            for t in f.model_types {
                assert_eq!(by_model_type(t).map(|e| e.family), Some(f.family), "{t}");
            }
            assert_eq!(
                by_gguf_architecture(f.gguf.0).map(|e| e.family),
                Some(f.family)
            );
            assert_eq!(by_model_type(f.gguf.1).map(|e| e.family), Some(f.family));
        }
        assert!(by_model_type("llama").is_none() && by_gguf_architecture("llama").is_none());
        assert_eq!(
            supported(false),
            "qwen3_moe, qwen3, qwen3_next, qwen3_5_moe, qwen3_5"
        );
    }
}
