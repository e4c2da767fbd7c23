//! The model's output: the final RMSNorm and the LM head (or the embedding matrix, when
//! tied), run only on the rows whose logits are wanted.

use corral_backend::{Backend, DeviceBuffer, WeightView};

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
