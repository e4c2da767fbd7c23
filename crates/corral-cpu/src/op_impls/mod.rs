//! The CPU backend's entries of the ops, a file for each family of ops.

mod attention;
mod copies;
mod delta_net;
mod matmul;
mod moe;
mod norms;
mod sampling;
