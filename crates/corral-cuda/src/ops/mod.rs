//! The CUDA backend's ops: for each family, the host half (`<family>.rs`: the kernels'
//! launches) beside its kernels (`<family>.cu`; `elementwise.cu` serves several
//! families, the `.cuh` headers all of them).

mod attention;
mod copies;
mod delta_net;
mod matmul;
mod moe;
mod norms;
pub(crate) mod quant;
mod sampling;
