//! The dense SwiGLU MLP: `down(silu(gate x) ⊙ up x)`.

use corral_backend::{Backend, DeviceBuffer, WeightView};

use super::Workspace;
use crate::Result;
use crate::weights::WeightSource;

/// Weights of a dense MLP.
#[derive(Debug)]
pub(crate) struct Mlp {
    gate_proj: DeviceBuffer,
    up_proj: DeviceBuffer,
    down_proj: DeviceBuffer,
    hidden: usize,
    inter: usize,
}

impl Mlp {
    /// Binds `{prefix}{gate,up,down}_proj.weight`.
    pub(crate) fn load(
        ckpt: &dyn WeightSource,
        backend: &dyn Backend,
        prefix: &str,
        hidden: usize,
        inter: usize,
    ) -> Result<Self> {
        Ok(Self {
            gate_proj: ckpt.weight(
                backend,
                &format!("{prefix}gate_proj.weight"),
                &[inter, hidden],
            )?,
            up_proj: ckpt.weight(
                backend,
                &format!("{prefix}up_proj.weight"),
                &[inter, hidden],
            )?,
            down_proj: ckpt.weight(
                backend,
                &format!("{prefix}down_proj.weight"),
                &[hidden, inter],
            )?,
            hidden,
            inter,
        })
    }

    /// `ws.out = mlp(ws.h)`.
    pub(crate) fn forward(
        &self,
        backend: &dyn Backend,
        ws: &mut Workspace,
        tokens: usize,
    ) -> Result<()> {
        self.forward_into(backend, ws, tokens, false)
    }

    /// `mlp(ws.h)` into `ws.out`, or into `ws.shared_out` when `shared` (the shared expert,
    /// which runs after the routed experts have filled `ws.out`).
    pub(crate) fn forward_into(
        &self,
        backend: &dyn Backend,
        ws: &mut Workspace,
        tokens: usize,
        shared: bool,
    ) -> Result<()> {
        let (h, i) = (self.hidden, self.inter);
        backend.matmuls(
            &ws.h,
            tokens,
            &[
                WeightView::new(&self.gate_proj, i, h)?,
                WeightView::new(&self.up_proj, i, h)?,
            ],
            &mut [&mut ws.gate, &mut ws.up],
        )?;
        backend.silu_mul(&ws.gate, &ws.up, tokens * i, &mut ws.act)?;
        let out = if shared {
            &mut ws.shared_out
        } else {
            &mut ws.out
        };
        backend.matmul(
            &ws.act,
            tokens,
            WeightView::new(&self.down_proj, h, i)?,
            out,
        )?;
        Ok(())
    }
}
