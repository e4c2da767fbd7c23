//! Layers shared by the model families, each a struct of immutable weights with a `forward`
//! that reads and writes buffers of the per-forward [`Workspace`].

pub(crate) mod attention;
pub(crate) mod mlp;
pub(crate) mod output_head;
pub(crate) mod workspace;

pub(crate) use workspace::Workspace;

use corral_backend::{Backend, DeviceBuffer};

use crate::Result;

/// The end of a decoder layer: the residual add of `ws.out` into `ws.x`, fused with the next
/// layer's input norm into `ws.h` (`offset_one`: the weight is stored as `w - 1`); after the
/// last layer the add alone.
pub(crate) fn residual_and_next_norm(
    backend: &dyn Backend,
    ws: &mut Workspace,
    next_norm: Option<&DeviceBuffer>,
    tokens: usize,
    hidden: usize,
    eps: f32,
    offset_one: bool,
) -> Result<()> {
    match next_norm {
        Some(w) => backend.add_rms_norm(
            &mut ws.x, &ws.out, w, tokens, hidden, eps, offset_one, &mut ws.h,
        )?,
        None => backend.add_in_place(&mut ws.x, &ws.out, tokens * hidden)?,
    }
    Ok(())
}
