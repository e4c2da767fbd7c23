//! The model's output: the final RMSNorm and the LM head (or the embedding matrix, when
//! tied), run only on the rows whose logits are wanted.

use corral_backend::{Backend, DType, DeviceBuffer, QuantFormat, WeightView};

use super::Workspace;
use crate::weights::WeightSource;
use crate::{ModelConfig, Result};

/// Final norm and LM head.
#[derive(Debug)]
pub(crate) struct OutputHead {
    norm: DeviceBuffer,
    /// `None` when tied to the embedding.
    lm_head: Option<DeviceBuffer>,
    zero_centred: bool,
}

impl OutputHead {
    /// Binds `norm_name` and, unless tied, `lm_head.weight`.
    pub(crate) fn load(
        src: &dyn WeightSource,
        backend: &dyn Backend,
        cfg: &ModelConfig,
        norm_name: &str,
    ) -> Result<Self> {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        Ok(Self {
            norm: src.weight_f32(backend, norm_name, &[h])?,
            lm_head: match cfg.tie_word_embeddings {
                true => None,
                false => Some(src.weight(backend, "lm_head.weight", &[v, h])?),
            },
            zero_centred: cfg.zero_centred_norms(),
        })
    }

    /// Stores the LM head (`embed` where tied) again as Q8_0, untied, where it is a float
    /// matrix of `[vocab, hidden]` whose rows Q8_0 blocks divide and the backend reads Q8_0;
    /// false, unchanged, otherwise.
    pub(crate) fn store_as_q8_0(
        &mut self,
        backend: &dyn Backend,
        embed: &DeviceBuffer,
        (vocab, hidden): (usize, usize),
    ) -> Result<bool> {
        let format = QuantFormat::Q8_0;
        let current = self.lm_head.as_ref().unwrap_or(embed);
        let dtype = current.dtype();
        let float = matches!(dtype, DType::F32 | DType::BF16 | DType::F16);
        if !float
            || !hidden.is_multiple_of(format.block().0)
            || !backend.capabilities().reads(format)
            || current.len() != vocab * hidden
        {
            return Ok(false);
        }
        // A few thousand rows at a time: read back, decoded, encoded.
        let rows = (1 << 22) / hidden.max(1) + 1;
        let elem = dtype.size_bytes();
        let mut blocks = Vec::with_capacity(format.bytes_of(vocab * hidden));
        let (mut bytes, mut values) = (Vec::new(), Vec::new());
        for first in (0..vocab).step_by(rows) {
            let n = rows.min(vocab - first) * hidden;
            bytes.resize(n * elem, 0);
            backend.read_bytes(current, first * hidden, &mut bytes)?;
            values.clear();
            dtype.extend_f32(&bytes, &mut values);
            blocks.extend(corral_backend::quant::encode_q8_0(&values));
        }
        self.lm_head =
            Some(backend.weight_from_blocks(blocks, DType::Quant(format), vocab * hidden)?);
        Ok(true)
    }

    /// `ws.logits = lm_head(norm(ws.x[logit rows]))`, and `ws.all_hidden = norm(ws.x)`
    /// where a step reads every hidden state; nothing when no logits are wanted.
    pub(crate) fn forward(
        &self,
        backend: &dyn Backend,
        cfg: &ModelConfig,
        ws: &mut Workspace,
        embed: &DeviceBuffer,
    ) -> Result<()> {
        let (h, v, rows) = (cfg.hidden_size, cfg.vocab_size, ws.num_logit_rows);
        let eps = cfg.rms_norm_eps;
        if let Some(all) = &mut ws.all_hidden {
            let tokens = all.len() / h;
            backend.rms_norm(&ws.x, &self.norm, tokens, h, eps, self.zero_centred, all)?;
        }
        if rows == 0 {
            return Ok(());
        }
        backend.gather_rows(&ws.x, &ws.batch.logit_rows, rows, h, &mut ws.rows)?;
        backend.rms_norm(
            &ws.rows,
            &self.norm,
            rows,
            h,
            eps,
            self.zero_centred,
            &mut ws.rows_normed,
        )?;
        let head = WeightView::new(self.lm_head.as_ref().unwrap_or(embed), v, h)?;
        backend.matmul(&ws.rows_normed, rows, head, &mut ws.logits)?;
        Ok(())
    }
}
