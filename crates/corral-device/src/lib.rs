//! Opens the backend a `--device` choice names, so that nothing above this crate names a
//! backend type: the CLI and the planner see a [`Backend`] and, for plans made without
//! opening one, a [`BackendKind`].

use std::sync::Arc;

use corral_backend::{Backend, DType};
use corral_cpu::CpuBackend;
use corral_cuda::{CudaBackend, CudaOptions};
use corral_vulkan::{VulkanBackend, VulkanOptions};

/// Where to run: the `--device` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU backend.
    Cpu,
    /// CUDA device N.
    Cuda(usize),
    /// Vulkan device N, in the loader's order (the backend computes part of the ops yet:
    /// the others refuse, saying so).
    Vulkan(usize),
    /// CUDA device 0 when usable, else the first Vulkan GPU (not a Vulkan implementation on
    /// the CPU), else the CPU.
    Auto,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "auto" => Ok(Self::Auto),
            "cuda" | "gpu" => Ok(Self::Cuda(0)),
            "vulkan" => Ok(Self::Vulkan(0)),
            _ => {
                let ordinal = |prefix| s.strip_prefix(prefix).and_then(|n| n.parse().ok());
                ordinal("cuda:")
                    .map(Self::Cuda)
                    .or_else(|| ordinal("vulkan:").map(Self::Vulkan))
                    .ok_or_else(|| {
                        format!(
                            "unknown device `{s}` (expected cpu, cuda, cuda:N, vulkan, vulkan:N or auto)"
                        )
                    })
            }
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
            Self::Vulkan(n) => write!(f, "vulkan:{n}"),
            Self::Auto => write!(f, "auto"),
        }
    }
}

/// A kind of backend, for what is known of it without opening one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend.
    Cuda,
    /// The Vulkan backend.
    Vulkan,
}

impl BackendKind {
    /// Whether the backend reads weights of block format `format` as stored (else a loader
    /// decodes them), known without opening a device.
    pub fn reads(self, format: corral_backend::QuantFormat) -> bool {
        match self {
            Self::Cpu => true,
            Self::Cuda => corral_cuda::cuda_weight_formats().contains(&format),
            Self::Vulkan => corral_vulkan::vulkan_weight_formats().contains(&format),
        }
    }

    /// Bytes of the buffers the backend allocates once at start, whatever the model.
    pub fn fixed_buffer_bytes(self) -> usize {
        match self {
            Self::Cpu => 0,
            Self::Cuda => corral_cuda::cuda_fixed_buffer_bytes(),
            Self::Vulkan => corral_vulkan::vulkan_fixed_buffer_bytes(),
        }
    }
}

/// What every backend is opened with.
#[derive(Debug, Clone, Copy)]
pub struct BackendOptions {
    /// The KV cache's element type.
    pub kv_dtype: DType,
    /// On a GPU, prefill's expert products take split bf16 activations (nearer f32).
    pub precise_experts: bool,
}

/// Why no backend opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The backend named refused to open.
    #[error("opening {device}: {source}")]
    Backend {
        /// The device, as `--device` names it.
        device: String,
        /// What it said.
        source: corral_backend::BackendError,
    },
}

/// Opens the backend `choice` names. `auto` tries CUDA, then a Vulkan GPU, and falls back to
/// the CPU, saying why, when no GPU is usable; an explicit `cuda` or `vulkan` fails with the
/// reason instead.
pub fn open(choice: DeviceChoice, options: BackendOptions) -> Result<Arc<dyn Backend>, OpenError> {
    let cpu = || {
        CpuBackend::with_kv_dtype(options.kv_dtype)
            .map(|b| Arc::new(b) as Arc<dyn Backend>)
            .map_err(|source| OpenError::Backend {
                device: "cpu".to_string(),
                source,
            })
    };
    let cuda = |ordinal| {
        CudaBackend::new(
            CudaOptions {
                ordinal,
                precise_experts: options.precise_experts,
                kv_dtype: Some(options.kv_dtype),
                ..Default::default()
            }
            .with_switches_from_env(),
        )
        .map(|b| Arc::new(b) as Arc<dyn Backend>)
        .map_err(|source| OpenError::Backend {
            device: format!("cuda:{ordinal}"),
            source,
        })
    };
    let vulkan = |ordinal| {
        VulkanBackend::new(
            VulkanOptions {
                ordinal,
                kv_dtype: Some(options.kv_dtype),
                ..Default::default()
            }
            .with_switches_from_env(),
        )
        .map(|b| Arc::new(b) as Arc<dyn Backend>)
        .map_err(|source| OpenError::Backend {
            device: format!("vulkan:{ordinal}"),
            source,
        })
    };
    match choice {
        DeviceChoice::Cpu => cpu(),
        DeviceChoice::Cuda(n) => cuda(n),
        DeviceChoice::Vulkan(n) => vulkan(n),
        DeviceChoice::Auto => {
            let gpu = || -> Result<Arc<dyn Backend>, String> {
                match corral_cuda::cuda_available() {
                    Ok(_) => match cuda(0) {
                        Ok(b) => return Ok(b),
                        Err(e) => tracing::warn!("cuda:0 is present but unusable ({e})"),
                    },
                    Err(why) => tracing::debug!("no CUDA device ({why})"),
                }
                match corral_vulkan::first_vulkan_gpu() {
                    Ok(Some(n)) => vulkan(n).map_err(|e| {
                        tracing::warn!("vulkan:{n} is present but unusable ({e})");
                        e.to_string()
                    }),
                    Ok(None) => Err("Vulkan finds no GPU".to_string()),
                    Err(why) => Err(why.to_string()),
                }
            };
            gpu().or_else(|why| {
                tracing::debug!("no usable GPU ({why}); running on the CPU");
                cpu()
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceChoice;

    /// Every spelling of `--device` parses to its choice and prints back as the canonical
    /// one; unknown names and ordinals that are no number are refused, listing the choices.
    #[test]
    fn device_choices_parse_and_print() {
        for (text, choice, shown) in [
            ("cpu", DeviceChoice::Cpu, "cpu"),
            ("auto", DeviceChoice::Auto, "auto"),
            ("cuda", DeviceChoice::Cuda(0), "cuda:0"),
            ("gpu", DeviceChoice::Cuda(0), "cuda:0"),
            ("cuda:3", DeviceChoice::Cuda(3), "cuda:3"),
            ("vulkan", DeviceChoice::Vulkan(0), "vulkan:0"),
            ("vulkan:1", DeviceChoice::Vulkan(1), "vulkan:1"),
        ] {
            assert_eq!(text.parse::<DeviceChoice>(), Ok(choice), "{text}");
            assert_eq!(choice.to_string(), shown);
        }
        for bad in ["tpu", "cuda:", "vulkan:x", "cuda:-1", ""] {
            let e = bad.parse::<DeviceChoice>().unwrap_err();
            assert!(e.contains("vulkan:N"), "{bad}: {e}");
        }
    }
}
