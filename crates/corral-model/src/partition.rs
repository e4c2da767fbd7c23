//! How a model splits over the ranks of a tensor-parallel group: attention by query heads
//! (the KV heads with them, or one KV head replicated where there are fewer KV heads than
//! ranks), the Gated DeltaNet by key heads (each with its value heads), the dense MLPs and
//! every expert by intermediate rows, the LM head by vocabulary; norms, the router, the
//! shared expert's gate and the embedding whole. A rank's layers compute partial sums of the
//! residual stream (its heads' share of the output projection, its rows' share of the down
//! projection), which the group adds: two all-reduces a layer.
//!
//! [`Partition::rank_config`] is the config a rank's model is built from (its heads and
//! intermediate sizes); [`Partition::shard`] says which part of each checkpoint tensor the
//! rank loads for it.

use std::ops::Range;

use crate::config::ModelConfig;
use crate::{ModelError, Result};

/// One rank of `ranks` splitting a model by tensor parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partition {
    rank: usize,
    ranks: usize,
}

/// Which part of a checkpoint tensor a rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shard {
    /// The whole tensor.
    Whole,
    /// These rows (first axis), in order.
    Rows(Vec<Range<usize>>),
    /// These columns (last axis) of every row.
    Columns(Range<usize>),
    /// Of each expert of a stacked `[experts, rows, cols]` tensor, these rows, in order.
    ExpertRows(Vec<Range<usize>>),
}

impl Partition {
    /// Rank `rank` of `ranks` (at least one).
    pub fn new(rank: usize, ranks: usize) -> Result<Self> {
        if rank >= ranks {
            return Err(ModelError::Unsupported(format!(
                "rank {rank} of a tensor-parallel group of {ranks}"
            )));
        }
        Ok(Self { rank, ranks })
    }

    /// This rank's number.
    pub fn rank(self) -> usize {
        self.rank
    }

    /// How many ranks share the model.
    pub fn ranks(self) -> usize {
        self.ranks
    }

    /// `n` split into equal parts over the ranks (named `what` where it does not split).
    fn part(self, what: &str, n: usize) -> Result<usize> {
        if !n.is_multiple_of(self.ranks) {
            return Err(ModelError::Unsupported(format!(
                "tensor parallel over {} ranks: the model's {what} ({n}) do not split evenly",
                self.ranks
            )));
        }
        Ok(n / self.ranks)
    }

    /// This rank's share of `n` things of `width` each: `[rank · n/ranks · width, …)`.
    fn range(self, what: &str, n: usize, width: usize) -> Result<Range<usize>> {
        let part = self.part(what, n)?;
        Ok(self.rank * part * width..(self.rank + 1) * part * width)
    }

    /// This rank's KV heads: its share where there are at least as many as ranks, else the
    /// one its query heads attend to (replicated on `ranks / kv_heads` ranks).
    fn kv_heads(self, kv_heads: usize) -> Result<Range<usize>> {
        if kv_heads >= self.ranks {
            return self.range("key/value heads", kv_heads, 1);
        }
        if !self.ranks.is_multiple_of(kv_heads) {
            return Err(ModelError::Unsupported(format!(
                "tensor parallel over {} ranks: {kv_heads} key/value heads neither split over \
                 them nor repeat evenly",
                self.ranks
            )));
        }
        let head = self.rank * kv_heads / self.ranks;
        Ok(head..head + 1)
    }

    /// The config of this rank's model: its share of the heads and intermediate rows, the
    /// rest as `config` (the vocabulary stays whole: token ids are the model's).
    pub fn rank_config(self, config: &ModelConfig) -> Result<ModelConfig> {
        let mut local = config.clone();
        local.num_heads = self.part("attention heads", config.num_heads)?;
        local.num_kv_heads = self.kv_heads(config.num_kv_heads)?.len();
        local.intermediate_size = self.part("MLP rows", config.intermediate_size)?;
        self.part("vocabulary rows", config.vocab_size)?;
        if let Some(moe) = &mut local.moe {
            moe.moe_intermediate_size = self.part("expert rows", moe.moe_intermediate_size)?;
        }
        if let Some(hybrid) = &mut local.hybrid {
            let linear = &mut hybrid.linear;
            linear.num_key_heads = self.part("linear key heads", linear.num_key_heads)?;
            linear.num_value_heads = self.part("linear value heads", linear.num_value_heads)?;
            if let Some(shared) = &mut hybrid.shared_expert_intermediate_size {
                *shared = self.part("shared expert rows", *shared)?;
            }
        }
        Ok(local)
    }

    /// Which part of checkpoint tensor `name` (as the loaders name it) this rank holds in a
    /// model of `config` (the whole model's).
    pub fn shard(self, config: &ModelConfig, name: &str) -> Result<Shard> {
        if self.ranks == 1 {
            return Ok(Shard::Whole);
        }
        let unknown = || {
            ModelError::Unsupported(format!(
                "{name}: no tensor-parallel split is known for this tensor"
            ))
        };
        // The part after the layer's prefix (`model.layers.{i}.`, `model.language_model.…`).
        let key = match name.find("layers.") {
            Some(at) => {
                let rest = &name[at + "layers.".len()..];
                rest.split_once('.').map_or(rest, |(_, key)| key)
            }
            None => name,
        };
        let hd = config.head_dim;
        let heads = self.range("attention heads", config.num_heads, 1)?;
        // A hybrid's gated attention interleaves each head's query and gate rows.
        let query_rows = if config.hybrid.is_some() { 2 * hd } else { hd };
        let rows = |r: Range<usize>| Ok(Shard::Rows(vec![r]));
        match key {
            "self_attn.q_proj.weight" => rows(heads.start * query_rows..heads.end * query_rows),
            "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => {
                let kv = self.kv_heads(config.num_kv_heads)?;
                rows(kv.start * hd..kv.end * hd)
            }
            "self_attn.o_proj.weight" => Ok(Shard::Columns(heads.start * hd..heads.end * hd)),
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" => {
                rows(self.range("MLP rows", config.intermediate_size, 1)?)
            }
            "mlp.down_proj.weight" => Ok(Shard::Columns(self.range(
                "MLP rows",
                config.intermediate_size,
                1,
            )?)),
            "input_layernorm.weight"
            | "post_attention_layernorm.weight"
            | "self_attn.q_norm.weight"
            | "self_attn.k_norm.weight"
            | "linear_attn.norm.weight"
            | "mlp.gate.weight"
            | "mlp.shared_expert_gate.weight"
            | "model.norm.weight"
            | "model.embed_tokens.weight"
            | "model.language_model.norm.weight"
            | "model.language_model.embed_tokens.weight" => Ok(Shard::Whole),
            "lm_head.weight" => rows(self.range("vocabulary rows", config.vocab_size, 1)?),
            _ if key.starts_with("linear_attn.") => self.delta_net_shard(config, key, unknown),
            _ if key.starts_with("mlp.") => self.moe_shard(config, key, unknown),
            _ => Err(unknown()),
        }
    }

    /// A Gated DeltaNet tensor's part: its key heads' rows of q and k, their value heads'
    /// of v, z, b, a, the decay and the convolution; Qwen3-Next's fused projections group
    /// rows by key head, so a run of whole groups.
    fn delta_net_shard(
        self,
        config: &ModelConfig,
        key: &str,
        unknown: impl Fn() -> ModelError,
    ) -> Result<Shard> {
        let linear = config.hybrid.as_ref().ok_or_else(&unknown)?.linear;
        let (nk, nv) = (linear.num_key_heads, linear.num_value_heads);
        let (dk, dv) = (linear.key_head_dim, linear.value_head_dim);
        let keys = self.range("linear key heads", nk, 1)?;
        let values = self.range("linear value heads", nv, 1)?;
        let scaled = |r: &Range<usize>, by: usize, at: usize| at + r.start * by..at + r.end * by;
        let per_group = nv / nk;
        Ok(match key {
            "linear_attn.in_proj_qkv.weight" | "linear_attn.conv1d.weight" => Shard::Rows(vec![
                scaled(&keys, dk, 0),
                scaled(&keys, dk, nk * dk),
                scaled(&values, dv, 2 * nk * dk),
            ]),
            "linear_attn.in_proj_z.weight" => Shard::Rows(vec![scaled(&values, dv, 0)]),
            "linear_attn.in_proj_b.weight"
            | "linear_attn.in_proj_a.weight"
            | "linear_attn.A_log"
            | "linear_attn.dt_bias" => Shard::Rows(vec![values]),
            "linear_attn.in_proj_qkvz.weight" => {
                Shard::Rows(vec![scaled(&keys, 2 * dk + 2 * per_group * dv, 0)])
            }
            "linear_attn.in_proj_ba.weight" => Shard::Rows(vec![scaled(&keys, 2 * per_group, 0)]),
            "linear_attn.out_proj.weight" => Shard::Columns(scaled(&values, dv, 0)),
            _ => return Err(unknown()),
        })
    }

    /// An expert's or the shared expert's part: its rows of gate and up, its columns of down.
    fn moe_shard(
        self,
        config: &ModelConfig,
        key: &str,
        unknown: impl Fn() -> ModelError,
    ) -> Result<Shard> {
        if let Some(rest) = key.strip_prefix("mlp.shared_expert.") {
            let size = config
                .hybrid
                .as_ref()
                .and_then(|h| h.shared_expert_intermediate_size)
                .ok_or_else(&unknown)?;
            let own = self.range("shared expert rows", size, 1)?;
            return match rest {
                "gate_proj.weight" | "up_proj.weight" => Ok(Shard::Rows(vec![own])),
                "down_proj.weight" => Ok(Shard::Columns(own)),
                _ => Err(unknown()),
            };
        }
        let size = config
            .moe
            .as_ref()
            .ok_or_else(&unknown)?
            .moe_intermediate_size;
        let own = self.range("expert rows", size, 1)?;
        match key {
            "mlp.experts.gate_up_proj" => Ok(Shard::ExpertRows(vec![
                own.clone(),
                size + own.start..size + own.end,
            ])),
            "mlp.experts.down_proj" => Ok(Shard::Columns(own)),
            _ => {
                // One expert's matrices: `mlp.experts.{e}.gate_proj.weight`, ...
                let per_expert = key
                    .strip_prefix("mlp.experts.")
                    .and_then(|rest| rest.split_once('.'))
                    .filter(|(e, _)| e.parse::<usize>().is_ok())
                    .map(|(_, matrix)| matrix);
                match per_expert {
                    Some("gate_proj.weight" | "up_proj.weight") => Ok(Shard::Rows(vec![own])),
                    Some("down_proj.weight") => Ok(Shard::Columns(own)),
                    _ => Err(unknown()),
                }
            }
        }
    }
}

impl Shard {
    /// The shape of this part of a tensor of `shape`.
    pub fn shape(&self, shape: &[usize]) -> Vec<usize> {
        let mut local = shape.to_vec();
        let total = |ranges: &[Range<usize>]| ranges.iter().map(ExactSizeIterator::len).sum();
        match self {
            Shard::Whole => {}
            Shard::Rows(ranges) => local[0] = total(ranges),
            Shard::Columns(range) => {
                if let Some(last) = local.last_mut() {
                    *last = range.len();
                }
            }
            Shard::ExpertRows(ranges) => local[1] = total(ranges),
        }
        local
    }

    /// This part of `values`, a tensor of `shape` (rows first), in order; an error naming
    /// `name` where a range lies past the shape.
    pub fn pick(&self, name: &str, values: &[f32], shape: &[usize]) -> Result<Vec<f32>> {
        let past = |what: &str| {
            ModelError::Unsupported(format!(
                "{name}: its tensor-parallel {what} lie past its shape {shape:?}"
            ))
        };
        let (rows, cols) = match shape {
            [] => (1, 1),
            [n] => (*n, 1),
            [first, rest @ ..] => (*first, rest.iter().product()),
        };
        if values.len() != rows * cols {
            return Err(past("values"));
        }
        let pick_rows =
            |ranges: &[Range<usize>], block: &[f32], width: usize, out: &mut Vec<f32>| {
                for r in ranges {
                    let part = block
                        .get(r.start * width..r.end * width)
                        .ok_or_else(|| past("rows"))?;
                    out.extend_from_slice(part);
                }
                Ok::<(), ModelError>(())
            };
        let mut out = Vec::new();
        match self {
            Shard::Whole => out.extend_from_slice(values),
            Shard::Rows(ranges) => pick_rows(ranges, values, cols, &mut out)?,
            Shard::Columns(range) => {
                let last = *shape.last().unwrap_or(&1);
                if range.end > last {
                    return Err(past("columns"));
                }
                for row in values.chunks_exact(last) {
                    out.extend_from_slice(&row[range.clone()]);
                }
            }
            Shard::ExpertRows(ranges) => {
                let [experts, expert_rows, width] = shape else {
                    return Err(past("expert rows"));
                };
                for expert in values
                    .chunks_exact((expert_rows * width).max(1))
                    .take(*experts)
                {
                    pick_rows(ranges, expert, *width, &mut out)?;
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
