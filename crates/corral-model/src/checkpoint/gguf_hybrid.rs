//! The hybrid architectures' GGUF files (`qwen35`, `qwen35moe`, `qwen3next`) seen in the
//! Hugging Face layout the hybrid family reads. llama.cpp's converter renames their tensors
//! and changes some (docs/gguf.md): norms are stored as `1 + w` (all but the DeltaNet's
//! gated norm), `A_log` as `-exp(A_log)`, Qwen3.5's value heads re-ordered from grouped by
//! key head to tiled (new head `j·K + g` is old head `g·r + j`) in every tensor indexed by
//! them, and Qwen3-Next's `in_proj_qkvz` split into the Qwen3.5 layout (`attn_qkv`,
//! `attn_gate`) with `in_proj_ba` kept. Each name maps to a file tensor, the rows or columns
//! to take from it, and the value change to undo.
//!
//! Files converted with their MTP head (the "-MTP-GGUF" conversions) carry its layers after the
//! trunk's (`blk.{L + i}`, `nextn_predict_layers` of them) with its own tensors under
//! `blk.{L}.nextn.*`; they read under the checkpoints' `mtp.*` names.

use crate::checkpoint::gguf_file::{GgufHeader, GgufValue};

/// Which hybrid architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HybridArch {
    /// `qwen35`, `qwen35moe`: value heads tiled when there are more than key heads.
    Qwen35,
    /// `qwen3next`: `ssm_ba` per key head, value heads in order.
    Qwen3Next,
}

/// The Gated DeltaNet sizes the layout changes depend on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HybridLayout {
    pub(crate) arch: HybridArch,
    /// Key heads.
    pub(crate) nk: usize,
    /// Value heads.
    pub(crate) nv: usize,
    /// Key head size.
    pub(crate) dk: usize,
    /// Value head size.
    pub(crate) dv: usize,
    /// The trunk's layers: the MTP head's follow them in the file.
    pub(crate) layers: usize,
    /// The MTP head's layers (`nextn_predict_layers`; none where the file has no head).
    pub(crate) mtp_layers: usize,
}

/// The change to a tensor's values the converter made, undone when read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ValueChange {
    None,
    /// Stored as `1 + w`.
    PlusOne,
    /// `A_log` stored as `-exp(A_log)`.
    NegatedExp,
}

/// Where a Hugging Face tensor of a hybrid is in the file.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Mapped {
    /// The file's tensor name.
    pub(crate) gguf: String,
    /// The file tensor's rows to take, in order (first axis; all when `None`).
    pub(crate) rows: Option<Vec<usize>>,
    /// The order of its columns (last axis; as stored when `None`).
    pub(crate) columns: Option<Vec<usize>>,
    pub(crate) values: ValueChange,
}

impl Mapped {
    fn plain(gguf: String) -> Self {
        Self {
            gguf,
            rows: None,
            columns: None,
            values: ValueChange::None,
        }
    }

    fn plus_one(gguf: String) -> Self {
        Self {
            values: ValueChange::PlusOne,
            ..Self::plain(gguf)
        }
    }

    fn rows(gguf: String, rows: Vec<usize>) -> Self {
        Self {
            rows: Some(rows),
            ..Self::plain(gguf)
        }
    }

    /// Whether the tensor is read as stored.
    pub(crate) fn as_stored(&self) -> bool {
        self.rows.is_none() && self.columns.is_none() && self.values == ValueChange::None
    }

    /// `values` (the file tensor decoded, `cols` to a row) as the Hugging Face tensor.
    pub(crate) fn apply(&self, values: &[f32], cols: usize) -> Vec<f32> {
        let rows: Vec<usize> = match &self.rows {
            Some(rows) => rows.clone(),
            None => (0..values.len() / cols.max(1)).collect(),
        };
        let mut out = Vec::with_capacity(rows.len() * cols);
        for r in rows {
            let row = &values[r * cols..(r + 1) * cols];
            match &self.columns {
                Some(order) => out.extend(order.iter().map(|&c| row[c])),
                None => out.extend_from_slice(row),
            }
        }
        match self.values {
            ValueChange::None => {}
            ValueChange::PlusOne => out.iter_mut().for_each(|v| *v -= 1.0),
            ValueChange::NegatedExp => out.iter_mut().for_each(|v| *v = (-*v).ln()),
        }
        out
    }
}

impl HybridLayout {
    /// The layout of a hybrid architecture's file, from its metadata; `None` for other
    /// architectures, an error naming a missing or bad key.
    pub(crate) fn from_header(arch: &str, header: &GgufHeader) -> Option<Result<Self, String>> {
        let kind = match arch {
            "qwen35" | "qwen35moe" => HybridArch::Qwen35,
            "qwen3next" => HybridArch::Qwen3Next,
            _ => return None,
        };
        let key = |k: &str| {
            let name = format!("{arch}.{k}");
            header
                .get(&name)
                .and_then(GgufValue::as_u64)
                .filter(|&v| v > 0)
                .map(|v| v as usize)
                .ok_or(format!("no positive integer `{name}`"))
        };
        let mtp_layers = header
            .get(&format!("{arch}.nextn_predict_layers"))
            .and_then(GgufValue::as_u64)
            .map_or(0, |v| v as usize);
        Some((|| {
            let nk = key("ssm.group_count")?;
            let nv = key("ssm.time_step_rank")?;
            let inner = key("ssm.inner_size")?;
            if !nv.is_multiple_of(nk) || !inner.is_multiple_of(nv) {
                return Err(format!(
                    "`{arch}.ssm.time_step_rank` {nv} is no multiple of `ssm.group_count` {nk}, or `ssm.inner_size` {inner} of it"
                ));
            }
            let blocks = key("block_count")?;
            let layers = blocks
                .checked_sub(mtp_layers)
                .filter(|&n| n > 0)
                .ok_or(format!(
                    "`{arch}.block_count` {blocks} leaves no layer beside {mtp_layers} MTP layers"
                ))?;
            Ok(Self {
                arch: kind,
                nk,
                nv,
                dk: key("ssm.state_size")?,
                dv: inner / nv,
                layers,
                mtp_layers,
            })
        })())
    }

    /// The file's value head at Hugging Face value head `h`: Qwen3.5's converter tiles them
    /// (old `g·r + j` to new `j·K + g`) where there are more value heads than key heads.
    fn file_head(&self, h: usize) -> usize {
        let r = self.nv / self.nk;
        if self.arch == HybridArch::Qwen35 && r > 1 {
            (h % r) * self.nk + h / r
        } else {
            h
        }
    }

    /// Rows `base + file_head(h)·per + i` for every value head h and `i < per`.
    fn value_rows(&self, base: usize, per: usize) -> Vec<usize> {
        (0..self.nv)
            .flat_map(|h| (0..per).map(move |i| base + self.file_head(h) * per + i))
            .collect()
    }

    /// The conv and in_proj_qkv channels: q and k as stored, v by head.
    fn qkv_rows(&self) -> Vec<usize> {
        let qk = 2 * self.nk * self.dk;
        let mut rows: Vec<usize> = (0..qk).collect();
        rows.extend(self.value_rows(qk, self.dv));
        rows
    }

    /// The name in the trunk's layout of an MTP layer's tensor `mtp.layers.{i}.*`: the
    /// converter writes MTP layer `i` as layer `L + i` after the trunk's `L`.
    pub(crate) fn mtp_layer_name(&self, name: &str) -> Option<String> {
        let (i, rest) = name.strip_prefix("mtp.layers.")?.split_once('.')?;
        let i: usize = i.parse().ok().filter(|&i| i < self.mtp_layers)?;
        Some(format!("model.layers.{}.{rest}", self.layers + i))
    }

    /// Whether file tensor `name` is the MTP head's (a block past the trunk's).
    pub(crate) fn holds_mtp(&self, name: &str) -> bool {
        let block = name.strip_prefix("blk.").and_then(|r| r.split_once('.'));
        block
            .and_then(|(n, _)| n.parse::<usize>().ok())
            .is_some_and(|n| n >= self.layers)
    }

    /// Where Hugging Face tensor `name` (text-only layout, `model.` prefix; `mtp.` for the
    /// MTP head's own tensors; its layers' names go through [`HybridLayout::mtp_layer_name`]
    /// first) is in the file.
    pub(crate) fn map(&self, name: &str) -> Option<Mapped> {
        let nextn = |s: &str| format!("blk.{}.nextn.{s}", self.layers);
        match name {
            "model.embed_tokens.weight" => return Some(Mapped::plain("token_embd.weight".into())),
            "model.norm.weight" => return Some(Mapped::plus_one("output_norm.weight".into())),
            "lm_head.weight" => return Some(Mapped::plain("output.weight".into())),
            _ if self.mtp_layers == 0 => {}
            "mtp.fc.weight" => return Some(Mapped::plain(nextn("eh_proj.weight"))),
            "mtp.pre_fc_norm_embedding.weight" => {
                return Some(Mapped::plus_one(nextn("enorm.weight")));
            }
            "mtp.pre_fc_norm_hidden.weight" => {
                return Some(Mapped::plus_one(nextn("hnorm.weight")));
            }
            "mtp.norm.weight" => return Some(Mapped::plus_one(nextn("shared_head_norm.weight"))),
            _ => {}
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let blk = |s: &str| format!("blk.{layer}.{s}");
        let r = self.nv / self.nk;
        let ba_rows = |at: usize| {
            (0..self.nk)
                .flat_map(|g| (0..r).map(move |i| g * 2 * r + at + i))
                .collect::<Vec<_>>()
        };
        Some(match rest {
            "input_layernorm.weight" => Mapped::plus_one(blk("attn_norm.weight")),
            "post_attention_layernorm.weight" => {
                Mapped::plus_one(blk("post_attention_norm.weight"))
            }
            "self_attn.q_norm.weight" => Mapped::plus_one(blk("attn_q_norm.weight")),
            "self_attn.k_norm.weight" => Mapped::plus_one(blk("attn_k_norm.weight")),
            "self_attn.q_proj.weight" => Mapped::plain(blk("attn_q.weight")),
            "self_attn.k_proj.weight" => Mapped::plain(blk("attn_k.weight")),
            "self_attn.v_proj.weight" => Mapped::plain(blk("attn_v.weight")),
            "self_attn.o_proj.weight" => Mapped::plain(blk("attn_output.weight")),
            "linear_attn.in_proj_qkv.weight" => {
                Mapped::rows(blk("attn_qkv.weight"), self.qkv_rows())
            }
            "linear_attn.in_proj_z.weight" => {
                Mapped::rows(blk("attn_gate.weight"), self.value_rows(0, self.dv))
            }
            "linear_attn.in_proj_b.weight" => match self.arch {
                HybridArch::Qwen35 => Mapped::rows(blk("ssm_beta.weight"), self.value_rows(0, 1)),
                HybridArch::Qwen3Next => Mapped::rows(blk("ssm_ba.weight"), ba_rows(0)),
            },
            "linear_attn.in_proj_a.weight" => match self.arch {
                HybridArch::Qwen35 => Mapped::rows(blk("ssm_alpha.weight"), self.value_rows(0, 1)),
                HybridArch::Qwen3Next => Mapped::rows(blk("ssm_ba.weight"), ba_rows(r)),
            },
            "linear_attn.conv1d.weight" => Mapped::rows(blk("ssm_conv1d.weight"), self.qkv_rows()),
            "linear_attn.A_log" => Mapped {
                values: ValueChange::NegatedExp,
                ..Mapped::rows(blk("ssm_a"), self.value_rows(0, 1))
            },
            "linear_attn.dt_bias" => Mapped::rows(blk("ssm_dt.bias"), self.value_rows(0, 1)),
            "linear_attn.norm.weight" => Mapped::plain(blk("ssm_norm.weight")),
            "linear_attn.out_proj.weight" => {
                let columns = self.value_rows(0, self.dv);
                let moved = columns.iter().enumerate().any(|(i, &c)| i != c);
                Mapped {
                    columns: moved.then_some(columns),
                    ..Mapped::plain(blk("ssm_out.weight"))
                }
            }
            "mlp.shared_expert.gate_proj.weight" => Mapped::plain(blk("ffn_gate_shexp.weight")),
            "mlp.shared_expert.up_proj.weight" => Mapped::plain(blk("ffn_up_shexp.weight")),
            "mlp.shared_expert.down_proj.weight" => Mapped::plain(blk("ffn_down_shexp.weight")),
            "mlp.shared_expert_gate.weight" => Mapped::plain(blk("ffn_gate_inp_shexp.weight")),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(arch: HybridArch) -> HybridLayout {
        HybridLayout {
            arch,
            nk: 2,
            nv: 6,
            dk: 1,
            dv: 2,
            layers: 4,
            mtp_layers: 1,
        }
    }

    /// The MTP head's tensors: its own under `blk.{L}.nextn`, its layer as layer L; none
    /// past its layers, and none in a file without a head.
    #[test]
    fn mtp_tensors_map_to_the_layers_after_the_trunk() {
        let l = layout(HybridArch::Qwen35);
        let fc = l.map("mtp.fc.weight").unwrap();
        assert_eq!(
            (fc.gguf.as_str(), fc.values),
            ("blk.4.nextn.eh_proj.weight", ValueChange::None)
        );
        let norm = l.map("mtp.pre_fc_norm_hidden.weight").unwrap();
        assert_eq!(
            (norm.gguf.as_str(), norm.values),
            ("blk.4.nextn.hnorm.weight", ValueChange::PlusOne)
        );
        let trunk = l
            .mtp_layer_name("mtp.layers.0.self_attn.q_norm.weight")
            .unwrap();
        let q = l.map(&trunk).unwrap();
        assert_eq!(
            (q.gguf.as_str(), q.values),
            ("blk.4.attn_q_norm.weight", ValueChange::PlusOne)
        );
        assert_eq!(
            l.mtp_layer_name("mtp.layers.0.mlp.experts.3.up_proj.weight")
                .as_deref(),
            Some("model.layers.4.mlp.experts.3.up_proj.weight")
        );
        assert_eq!(
            l.mtp_layer_name("mtp.layers.1.input_layernorm.weight"),
            None
        );
        assert!(l.holds_mtp("blk.4.nextn.eh_proj.weight") && l.holds_mtp("blk.4.attn_q.weight"));
        assert!(!l.holds_mtp("blk.3.attn_q.weight") && !l.holds_mtp("output.weight"));
        let without = HybridLayout { mtp_layers: 0, ..l };
        assert!(without.map("mtp.fc.weight").is_none());
        assert!(
            without
                .mtp_layer_name("mtp.layers.0.self_attn.q_proj.weight")
                .is_none()
        );
    }

    /// Qwen3.5's tiled value heads: HF head g·r + j is file head j·K + g (K = 2, r = 3), so
    /// HF heads 0..6 are file heads 0, 2, 4, 1, 3, 5; Qwen3-Next keeps them.
    #[test]
    fn value_heads_untile_as_the_converter_tiled_them() {
        let l = layout(HybridArch::Qwen35);
        let heads: Vec<usize> = (0..6).map(|h| l.file_head(h)).collect();
        assert_eq!(heads, [0, 2, 4, 1, 3, 5]);
        let z = l
            .map("model.layers.0.linear_attn.in_proj_z.weight")
            .unwrap();
        assert_eq!(z.rows.unwrap(), [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]);
        let qkv = l.map("model.layers.0.linear_attn.conv1d.weight").unwrap();
        assert_eq!(qkv.rows.unwrap()[..6], [0, 1, 2, 3, 4, 5]);
        let next = layout(HybridArch::Qwen3Next);
        assert_eq!(
            (0..6).map(|h| next.file_head(h)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 5]
        );
        // ssm_ba per key head: [b(3), a(3)] twice.
        let a = next
            .map("model.layers.1.linear_attn.in_proj_a.weight")
            .unwrap();
        assert_eq!(a.gguf, "blk.1.ssm_ba.weight");
        assert_eq!(a.rows.unwrap(), [3, 4, 5, 9, 10, 11]);
        assert!(
            next.map("model.layers.1.linear_attn.out_proj.weight")
                .unwrap()
                .columns
                .is_none()
        );
    }

    #[test]
    fn stored_values_are_changed_back() {
        let norm = Mapped::plus_one("n".into());
        assert_eq!(norm.apply(&[1.5, 0.25], 2), [0.5, -0.75]);
        let a = Mapped {
            values: ValueChange::NegatedExp,
            ..Mapped::rows("a".into(), vec![1, 0])
        };
        let got = a.apply(&[-(2f32.exp()), -(0.5f32.exp())], 1);
        assert!(
            (got[0] - 0.5).abs() < 1e-6 && (got[1] - 2.0).abs() < 1e-6,
            "{got:?}"
        );
        let cols = Mapped {
            columns: Some(vec![2, 0, 1]),
            ..Mapped::plain("o".into())
        };
        assert_eq!(
            cols.apply(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3),
            [3.0, 1.0, 2.0, 6.0, 4.0, 5.0]
        );
    }
}
