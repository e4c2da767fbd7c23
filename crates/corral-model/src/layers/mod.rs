//! Layers shared by the model families, each a struct of immutable weights with a `forward`
//! that reads and writes buffers of the per-forward [`Workspace`].

pub(crate) mod attention;
pub(crate) mod mlp;
pub(crate) mod output_head;
pub(crate) mod workspace;

pub(crate) use workspace::Workspace;
