//! The Vulkan backend, in the making: the device opened through the Vulkan loader at run time
//! (one binary with or without a Vulkan driver), what it can do as data, buffers reached by
//! their device addresses, and compute shaders compiled to SPIR-V by the build, dispatched
//! from recorded command buffers. It runs on Mesa's lavapipe (Vulkan on the CPU), RADV on
//! AMD's iGPUs and NVIDIA's driver alike. Not yet a [`corral_backend::Backend`]: the ops come
//! next, each against the op conformance suite.

mod device;
mod kernel;
mod memory;

pub use device::{VulkanDevice, VulkanInfo, vulkan_available};
pub use kernel::{Kernel, Recording};
pub use memory::VulkanBuffer;

include!(concat!(env!("OUT_DIR"), "/shaders.rs"));

/// A Vulkan call's failure as the backend's error.
fn vk_err(what: &str, e: ash::vk::Result) -> corral_backend::BackendError {
    corral_backend::BackendError::Device {
        what: what.to_string(),
        detail: e.to_string(),
    }
}
