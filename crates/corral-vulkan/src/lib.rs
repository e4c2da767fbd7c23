//! The Vulkan backend: the device opened through the Vulkan loader at run time (one binary
//! with or without a Vulkan driver), what it can do as data, buffers reached by their device
//! addresses, and compute shaders compiled to SPIR-V by the build, recorded into one command
//! buffer a step and replayed as graphs. It runs on Mesa's lavapipe (Vulkan on the CPU),
//! RADV on AMD's iGPUs and NVIDIA's driver alike. Every op is computed, in f32 from float
//! weights (f32, bf16, f16) or block-format weights read as stored (ggml's Q4_0 ... Q6_K,
//! FP8 rows), with an f32 or bf16 KV cache, by portable shaders written for correctness
//! first: the fast per-device kernels come next.

mod args;
mod backend;
mod device;
mod device_impl;
mod kernel;
mod memory;
mod ops;
mod profile;
mod stream;
mod transfer;

pub use backend::{VulkanBackend, VulkanOptions};
pub use device::{VulkanDevice, VulkanInfo, first_vulkan_gpu, vulkan_available};
pub use kernel::Kernel;
pub use memory::VulkanBuffer;

include!(concat!(env!("OUT_DIR"), "/shaders.rs"));

/// The block formats the Vulkan backend reads as stored (its `Capabilities::weight_formats`,
/// known without a device).
pub fn vulkan_weight_formats() -> &'static [corral_backend::QuantFormat] {
    &ops::BLOCK_FORMATS
}

/// Bytes of the buffers the Vulkan backend allocates once at start, whatever the model (the
/// chunked delta rule's scratch), for memory plans.
pub fn vulkan_fixed_buffer_bytes() -> usize {
    ops::DELTA_SCRATCH_BYTES
}

/// A Vulkan call's failure as the backend's error.
fn vk_err(what: &str, e: ash::vk::Result) -> corral_backend::BackendError {
    corral_backend::BackendError::Device {
        what: what.to_string(),
        detail: e.to_string(),
    }
}
