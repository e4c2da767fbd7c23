//! `corral plan`: what serving a model at a context and a concurrency needs in memory, whether
//! it fits a budget and by how much, and the largest context and concurrency it allows.
//! Works from `config.json` and the checkpoint's headers; nothing is loaded.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use corral_backend::DType;
use corral_engine::{BLOCK_SIZE, MemoryNeeds, MemoryPlan, PlanRequest, mem_available, plan};
use corral_model::checkpoint::GgufCheckpoint;
use corral_model::{Checkpoint, ModelConfig};

use crate::speculative::Speculative;

/// Share of `MemAvailable` a CPU plan takes when no budget is given.
const MEM_AVAILABLE_SHARE: f64 = 0.9;

/// Device memory the CUDA runtime holds before Corral's first buffer (the context, cuBLAS and
/// the loaded kernels): 780–860 MiB measured on an H200. `serve` reads it on the device.
const CUDA_RUNTIME_BYTES: u64 = 860 << 20;

/// Where the model would run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum PlanDevice {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend.
    Cuda,
    /// The Vulkan backend (an integrated GPU's budget is the host's memory).
    Vulkan,
}

impl PlanDevice {
    /// The backend it names.
    fn kind(self) -> corral_device::BackendKind {
        match self {
            Self::Cpu => corral_device::BackendKind::Cpu,
            Self::Cuda => corral_device::BackendKind::Cuda,
            Self::Vulkan => corral_device::BackendKind::Vulkan,
        }
    }
}

/// Arguments of `corral plan`.
#[derive(Debug, Args)]
pub(crate) struct PlanArgs {
    /// Hugging Face checkpoint directory (config.json and the safetensors headers are read).
    #[arg(
        long,
        conflicts_with = "synthetic",
        required_unless_present = "synthetic"
    )]
    model: Option<PathBuf>,
    /// A config.json alone, for a model of synthetic weights (bf16 unless it says float32 or
    /// float16).
    #[arg(long)]
    synthetic: Option<PathBuf>,
    /// The byte budget (1073741824, 512M, 96G). Default on the CPU and on Vulkan (an
    /// integrated GPU's memory is the host's; give it for a discrete one): 90% of
    /// MemAvailable.
    #[arg(long, value_parser = super::serve::parse_bytes)]
    memory: Option<usize>,
    /// Tokens each sequence may reach (default: the model's context, YaRN's where it scales).
    #[arg(long)]
    context: Option<usize>,
    /// Sequences at once.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Resident sessions whose recurrent-state checkpoints are kept (hybrid models).
    #[arg(long, default_value_t = 0)]
    sessions: usize,
    /// Where it would run.
    #[arg(long, value_enum, default_value = "cpu")]
    device: PlanDevice,
    /// Most tokens a step takes, as `serve --max-prefill-tokens` (its activations are the
    /// workspace).
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// The KV cache's element type (bf16 or f32), as `serve --kv-dtype`.
    #[arg(long, default_value = "bf16", value_parser = crate::loading::parse_kv_dtype)]
    kv_dtype: corral_backend::DType,
    /// Speculative decoding as `serve --speculative` runs it: an MTP head drafting beside
    /// the model (`mtp`, `mtp+lookup`, or `auto` on the CPU) counts its weights and its KV.
    #[arg(long, default_value = "auto")]
    speculative: Speculative,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(args: PlanArgs) -> Result<()> {
    // The model's weight bytes, and its MTP head's own tensors' (0 without one).
    let (config, (weights, head), name) = match (&args.model, &args.synthetic) {
        (Some(file), _) if file.is_file() => {
            let gguf = GgufCheckpoint::open(file)
                .with_context(|| format!("reading the GGUF model {}", file.display()))?;
            let config = gguf
                .config()
                .with_context(|| format!("reading the GGUF model {}", file.display()))?;
            // Block formats the backend reads stay as stored; it decodes the others.
            let kind = args.device.kind();
            let loaded = gguf.loaded_bytes(&|format| kind.reads(format)) as u64;
            let head = gguf.mtp_size().1 as u64;
            (config, (loaded, head), file.display().to_string())
        }
        (Some(dir), _) => {
            let path = dir.join("config.json");
            let config = ModelConfig::from_file(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let checkpoint = Checkpoint::open(dir)
                .with_context(|| format!("reading the checkpoint in {}", dir.display()))?;
            let sizes = (
                checkpoint.total_bytes() as u64,
                checkpoint.mtp_size().1 as u64,
            );
            (config, sizes, dir.display().to_string())
        }
        (None, Some(path)) => {
            let config = ModelConfig::from_file(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let weights = corral_model::Model::synthetic_weight_bytes(&config) as u64;
            (
                config,
                (weights, 0),
                format!("synthetic {}", path.display()),
            )
        }
        (None, None) => bail!("give --model DIR|FILE.gguf or --synthetic CONFIG"),
    };
    let drafting = args.speculative.wants_head();
    if drafting && head == 0 && args.speculative != Speculative::Auto {
        bail!(
            "--speculative {} needs the checkpoint's MTP head",
            args.speculative
        );
    }
    let kv_dtype = args.kv_dtype;
    let fixed = match args.device {
        PlanDevice::Cpu | PlanDevice::Vulkan => 0,
        PlanDevice::Cuda => {
            corral_device::BackendKind::Cuda.fixed_buffer_bytes() as u64 + CUDA_RUNTIME_BYTES
        }
    };
    let (budget, source) = match (args.memory, args.device) {
        (Some(bytes), _) => (bytes as u64, "given".to_string()),
        (None, PlanDevice::Cpu | PlanDevice::Vulkan) => host_budget(mem_available(), "")?,
        (None, PlanDevice::Cuda) => {
            bail!("give --memory: plan does not read a GPU's free memory")
        }
    };
    if args.concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    let mut needs = MemoryNeeds::of(
        &config,
        weights,
        kv_dtype,
        args.prefill_chunk.max(args.concurrency).max(1),
        fixed,
        BLOCK_SIZE,
    );
    if drafting && head > 0 {
        // Its own tensors and its copies of the embedding and LM head, as `serve` counts them.
        let copied = corral_model::Model::mtp_copied_bytes(&config) as u64;
        let kv = config.mtp()?.kv_bytes_per_token(kv_dtype) as u64;
        needs.add_draft_head(head + copied, kv);
    }
    needs.add_kept_states(args.speculative.kept_state_slots(
        (config.hybrid.is_some(), drafting && head > 0),
        args.concurrency,
    ));
    let context = args.context.unwrap_or(config.max_context());
    if context > config.max_context() {
        bail!(
            "--context {context} is beyond the model's context ({}: max_position_embeddings, or YaRN's original context times its factor)",
            config.max_context()
        );
    }
    let checkpoints = if needs.state_per_sequence > 0 {
        args.sessions
    } else {
        0
    };
    let request = PlanRequest {
        budget,
        context,
        concurrency: args.concurrency,
        checkpoints,
        session_index: 0,
    };
    let plan = plan(&needs, request);
    if args.json {
        let mut value = serde_json::to_value(&plan)?;
        value["model"] = name.into();
        value["budget_source"] = source.into();
        value["fits"] = plan.fits().into();
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", plan_text(&name, &source, &plan, kv_dtype));
    }
    Ok(())
}

/// The plan as `corral plan` prints it.
pub(crate) fn plan_text(name: &str, source: &str, p: &MemoryPlan, kv_dtype: DType) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let n = &p.needs;
    let r = &p.request;
    let _ = writeln!(out, "model      {name}");
    let _ = writeln!(out, "budget     {} ({source})", gib(r.budget));
    let _ = writeln!(out, "weights    {}", gib(n.weights));
    let _ = writeln!(
        out,
        "workspace  {} (a step's activations, fixed buffers and the device runtime)",
        gib(n.workspace)
    );
    let _ = writeln!(
        out,
        "KV         {} bytes a token ({kv_dtype})",
        n.kv_per_token,
    );
    if r.session_index > 0 {
        let _ = writeln!(
            out,
            "sessions   {} for the session folder's index at its byte cap",
            gib(r.session_index)
        );
    }
    if n.state_per_sequence > 0 {
        let _ = writeln!(
            out,
            "state      {} a sequence, {} checkpoints",
            gib(n.state_per_sequence),
            r.checkpoints
        );
    }
    let _ = writeln!(
        out,
        "asked      {} tokens at C={}: KV {}, states {}, total {}",
        r.context,
        r.concurrency,
        gib(p.kv),
        gib(p.states),
        gib(p.total)
    );
    if p.fits() {
        let _ = writeln!(out, "fits       yes, {} spare", gib(p.spare as u64));
    } else if !p.weights_fit {
        let _ = writeln!(
            out,
            "fits       no: the weights and workspace alone are {} over the budget",
            gib((n.weights + n.workspace).saturating_sub(r.budget))
        );
    } else {
        let _ = writeln!(
            out,
            "fits       no, short by {}",
            gib(p.spare.unsigned_abs() as u64)
        );
    }
    let _ = writeln!(
        out,
        "largest    context {} at C={} (model max {}); C={} at {} tokens; {} KV blocks of {}",
        p.max_context,
        r.concurrency,
        n.max_position,
        p.max_concurrency,
        r.context,
        p.kv_blocks,
        n.block_size
    );
    out
}

/// The budget on the CPU or a unified-memory device when none is given: a share of
/// `MemAvailable` (`available`; `when` says when it was read, for the source text).
pub(crate) fn host_budget(available: Option<u64>, when: &str) -> Result<(u64, String)> {
    let available =
        available.context("no /proc/meminfo to read MemAvailable from: give --memory")?;
    let budget = (available as f64 * MEM_AVAILABLE_SHARE) as u64;
    let share = (MEM_AVAILABLE_SHARE * 100.0).round();
    Ok((
        budget,
        format!("{share}% of MemAvailable {}{when}", gib(available)),
    ))
}

/// Bytes in GiB with two decimals.
pub(crate) fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}
