//! The CUDA backend's host halves of the ops, a file for each family of ops (as `kernels/` holds a `.cu` file for each).

mod attention;
mod copies;
mod delta_net;
mod matmul;
mod moe;
mod norms;
mod sampling;
