//! Shared start-up of model commands: the thread pool, the backend, and loading weights (or
//! making synthetic ones) with a progress bar.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use anyhow::{Context, Result};
use clap::Args;
use corral_backend::{Backend, DType};
use corral_device::{BackendOptions, DeviceChoice};
use corral_engine::{Tokenizer, TokenizerConfig};
use corral_model::checkpoint::GgufCheckpoint;
use corral_model::{Model, ModelConfig, MoeStrategy, SyntheticMix};

/// Options every model-loading command takes.
#[derive(Debug, Args)]
pub(crate) struct ModelArgs {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files), or a
    /// GGUF file (qwen3, qwen3moe, qwen35, qwen35moe, qwen3next) with its vocabulary and chat
    /// template.
    #[arg(
        long,
        env = "CORRAL_MODEL",
        required_unless_present = "synthetic",
        conflicts_with = "synthetic"
    )]
    pub(crate) model: Option<PathBuf>,
    /// Build the model from this config.json alone, with deterministic random weights.
    #[arg(long)]
    pub(crate) synthetic: Option<PathBuf>,
    /// With `--synthetic`: the matrices' storage: `float` (the config's type), `q8_0`,
    /// `q4_k_m` (Q4_K, Q6_K where llama.cpp's Q4_K_M puts it) or `fp8` (e4m3, a scale per
    /// 128 values, as Qwen's FP8 checkpoints); random blocks of the same spread.
    #[arg(long, default_value = "float", requires = "synthetic", value_parser = parse_mix)]
    pub(crate) synthetic_weights: SyntheticMix,
    /// CPU threads for compute (default: all cores).
    #[arg(long, env = "CORRAL_THREADS")]
    pub(crate) threads: Option<usize>,
    /// How MoE layers run their experts.
    #[arg(long, default_value = "auto", value_parser = parse_strategy)]
    pub(crate) moe_strategy: MoeStrategy,
    /// Where to run: `cpu`, `cuda` or `cuda:N`, or `auto` (CUDA when a usable GPU is present).
    #[arg(long, env = "CORRAL_DEVICE", default_value = "auto", value_parser = parse_device)]
    pub(crate) device: DeviceChoice,
    /// With `--moe-strategy auto`: routed tokens from which the grouped strategy runs.
    /// Default: measured at start-up on a GPU (cached per device and shape), and the
    /// measured CPU constant on the CPU.
    #[arg(long)]
    pub(crate) moe_grouped_min_tokens: Option<usize>,
    /// The KV cache's element type: `bf16` (half the memory of f32; on every backend), `fp8`
    /// (e4m3 with a scale per token and KV head, about half of bf16; on the GPU) or `f32`
    /// (exact, as the conformance tests run).
    #[arg(long, env = "CORRAL_KV_DTYPE", default_value = "bf16", value_parser = parse_kv_dtype)]
    pub(crate) kv_dtype: DType,
    /// On the GPU, prefill's expert products take their activations as split bf16 pairs
    /// (about 16 significant bits) instead of rounding them to bf16: errors near f32's, at
    /// about 1.4 times the prefill time of bf16 experts (docs/performance.md).
    #[arg(long)]
    pub(crate) precise_experts: bool,
    /// The GGUF file `--model` names, opened once: its header serves the model, the
    /// vocabulary and the stop ids.
    #[arg(skip)]
    gguf: OnceLock<GgufCheckpoint>,
}

/// `--kv-dtype`: bf16, fp8 or f32.
pub(crate) fn parse_kv_dtype(s: &str) -> Result<DType, String> {
    match s {
        "bf16" => Ok(DType::BF16),
        "f32" => Ok(DType::F32),
        "fp8" | "f8" | "e4m3" => Ok(DType::F8E4M3),
        _ => Err(format!("unknown KV type `{s}` (bf16, fp8 or f32)")),
    }
}

/// `--device`: cpu, cuda, cuda:N, vulkan, vulkan:N or auto.
fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    s.parse()
}

/// Opens the backend `choice` names (`auto`: CUDA device 0 when usable, else the CPU).
pub(crate) fn open_backend(
    choice: DeviceChoice,
    kv_dtype: DType,
    precise_experts: bool,
) -> Result<Arc<dyn Backend>> {
    Ok(corral_device::open(
        choice,
        BackendOptions {
            kv_dtype,
            precise_experts,
        },
    )?)
}

/// `--synthetic-weights`: float, q8_0, q4_k_m or fp8.
fn parse_mix(s: &str) -> Result<SyntheticMix, String> {
    match s.to_ascii_lowercase().as_str() {
        "float" => Ok(SyntheticMix::Float),
        "q8_0" => Ok(SyntheticMix::Q8_0),
        "q4_k_m" => Ok(SyntheticMix::Q4KM),
        "fp8" => Ok(SyntheticMix::Fp8),
        _ => Err(format!(
            "unknown synthetic weights `{s}` (float, q8_0, q4_k_m or fp8)"
        )),
    }
}

fn parse_strategy(s: &str) -> Result<MoeStrategy, String> {
    s.parse()
        .map_err(|e: corral_model::UnknownStrategy| e.to_string())
}

impl ModelArgs {
    /// The strategy with the `auto` threshold applied.
    pub(crate) fn strategy(&self) -> MoeStrategy {
        match self.moe_strategy {
            MoeStrategy::Auto { .. } => MoeStrategy::Auto {
                grouped_min_tokens: self
                    .moe_grouped_min_tokens
                    .unwrap_or(corral_model::DEFAULT_GROUPED_MIN_TOKENS),
            },
            other => other,
        }
    }

    /// The checkpoint directory or GGUF file, when the model comes from one.
    pub(crate) fn dir(&self) -> Option<&Path> {
        self.model.as_deref()
    }

    /// The GGUF file `--model` names (none for a directory or a synthetic model), its
    /// header read on the first call only.
    pub(crate) fn gguf(&self) -> Result<Option<&GgufCheckpoint>> {
        let Some(file) = self.model.as_deref().filter(|p| p.is_file()) else {
            return Ok(None);
        };
        if let Some(opened) = self.gguf.get() {
            return Ok(Some(opened));
        }
        let opened = GgufCheckpoint::open(file)
            .with_context(|| format!("reading the GGUF file {}", file.display()))?;
        Ok(Some(self.gguf.get_or_init(|| opened)))
    }

    /// The tokenizer and template config in `dir`: the model's own GGUF header when `dir`
    /// is that file.
    pub(crate) fn vocabulary(&self, dir: &Path) -> Result<(Tokenizer, TokenizerConfig)> {
        match self.gguf()? {
            Some(gguf) if self.dir() == Some(dir) => {
                Ok(corral_engine::vocabulary_from_gguf(gguf, dir)?)
            }
            _ => Ok(corral_engine::load_vocabulary(dir)?),
        }
    }

    /// The ids that end generation: config.json's `eos` and what `dir` (the vocabulary's
    /// directory or GGUF file) adds.
    pub(crate) fn stop_ids(&self, dir: &Path, eos: &[u32]) -> Result<Vec<u32>> {
        match self.gguf()? {
            Some(gguf) if self.dir() == Some(dir) => {
                Ok(corral_engine::gguf_stop_token_ids(gguf, eos))
            }
            _ => Ok(corral_engine::stop_token_ids(dir, eos)?),
        }
    }

    /// These options with some replaced, from `key=value` pairs separated by commas: `model`,
    /// `device`, `kv-dtype`, `moe-strategy`, `precise-experts`, `threads` (for a second
    /// configuration beside
    /// this one, as `corral eval --against` takes it).
    pub(crate) fn with_overrides(&self, spec: &str) -> Result<ModelArgs> {
        let mut args = ModelArgs {
            model: self.model.clone(),
            synthetic: self.synthetic.clone(),
            synthetic_weights: self.synthetic_weights,
            threads: self.threads,
            moe_strategy: self.moe_strategy,
            device: self.device,
            moe_grouped_min_tokens: self.moe_grouped_min_tokens,
            kv_dtype: self.kv_dtype,
            precise_experts: self.precise_experts,
            gguf: OnceLock::new(),
        };
        for pair in spec.split(',').filter(|p| !p.trim().is_empty()) {
            let (key, value) = pair.split_once('=').with_context(|| {
                format!("`{pair}` is not key=value (keys: model, device, kv-dtype, moe-strategy, precise-experts, threads)")
            })?;
            let value = value.trim();
            let bad = |e: String| anyhow::anyhow!("{key}: {e}");
            match key.trim() {
                "model" => {
                    args.model = Some(PathBuf::from(value));
                    args.synthetic = None;
                }
                "device" => args.device = parse_device(value).map_err(bad)?,
                "kv-dtype" => args.kv_dtype = parse_kv_dtype(value).map_err(bad)?,
                "moe-strategy" => args.moe_strategy = parse_strategy(value).map_err(bad)?,
                "precise-experts" => {
                    args.precise_experts = value.parse().map_err(|e| bad(format!("{e}")))?
                }
                "threads" => args.threads = Some(value.parse().map_err(|e| bad(format!("{e}")))?),
                other => anyhow::bail!(
                    "unknown key `{other}` (keys: model, device, kv-dtype, moe-strategy, precise-experts, threads)"
                ),
            }
        }
        Ok(args)
    }

    /// The model and how it runs (device, KV type, MoE strategy), for reports.
    pub(crate) fn describe_run(&self) -> String {
        let device = self.device;
        let kv = match self.kv_dtype {
            DType::F32 => "f32",
            DType::F8E4M3 => "fp8",
            _ => "bf16",
        };
        format!(
            "{} ({device}, KV {kv}, {})",
            self.describe(),
            self.moe_strategy
        )
    }

    /// What the model is, for reports.
    pub(crate) fn describe(&self) -> String {
        match (&self.model, &self.synthetic) {
            (Some(dir), _) => dir.display().to_string(),
            (_, Some(config)) if self.synthetic_weights == SyntheticMix::Float => {
                format!("synthetic:{}", config.display())
            }
            (_, Some(config)) => format!(
                "synthetic:{} ({:?})",
                config.display(),
                self.synthetic_weights
            ),
            _ => String::new(),
        }
    }
}

/// Sizes the process-wide thread pool once.
/// A second model in the same process shares the pool the first sized; asking it for another
/// size is an error.
pub(crate) fn init_threads(threads: Option<usize>) -> Result<()> {
    static SIZED: OnceLock<usize> = OnceLock::new();
    let threads = match threads {
        Some(0) => anyhow::bail!("--threads must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    if let Some(&sized) = SIZED.get() {
        if sized != threads {
            anyhow::bail!("the thread pool already has {sized} threads, not {threads}");
        }
        return Ok(());
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .context("starting the thread pool")?;
    let _ = SIZED.set(threads);
    Ok(())
}

/// The seed of `--synthetic` weights (and of a synthetic model's MTP head).
pub(crate) const SYNTHETIC_SEED: u64 = 0;

/// Loads (or makes) the model of `args` on the backend `--device` names, with a progress bar
/// on stderr.
pub(crate) fn load_model(args: &ModelArgs) -> Result<Model> {
    init_threads(args.threads)?;
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(args.describe());
    let backend = open_backend(args.device, args.kv_dtype, args.precise_experts)?;
    let mut progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let model = match (&args.model, &args.synthetic) {
        (Some(file), _) if file.is_file() => args
            .gguf()
            .and_then(|gguf| {
                let gguf = gguf.context("the GGUF file was not opened")?;
                Ok(Model::from_gguf(gguf, backend, &mut progress)?)
            })
            .with_context(|| format!("loading the GGUF model {}", file.display())),
        (Some(dir), _) => {
            if !dir.is_dir() {
                anyhow::bail!(
                    "{}: neither a checkpoint directory nor a GGUF file",
                    dir.display()
                );
            }
            Model::load(dir, backend, &mut progress)
                .with_context(|| format!("loading model from {}", dir.display()))
        }
        (None, Some(config)) => ModelConfig::from_file(config)
            .map_err(anyhow::Error::from)
            .and_then(|c| {
                let mix = args.synthetic_weights;
                Ok(Model::synthetic_mixed(
                    c,
                    mix,
                    backend,
                    SYNTHETIC_SEED,
                    &mut progress,
                )?)
            })
            .with_context(|| format!("building a synthetic model from {}", config.display())),
        (None, None) => anyhow::bail!("give --model DIR|FILE.gguf or --synthetic CONFIG.json"),
    };
    bar.finish_and_clear();
    let mut model = model?;
    model.set_moe_strategy(args.strategy());
    let on_cpu = model.backend().device_name().starts_with("cpu");
    if matches!(args.moe_strategy, MoeStrategy::Auto { .. })
        && args.moe_grouped_min_tokens.is_none()
        && !on_cpu
    {
        calibrate_auto_threshold(&mut model)?;
    }
    Ok(model)
}

/// Sets the `auto` threshold from a measurement of this model on its device, and says so.
pub(crate) fn calibrate_auto_threshold(model: &mut Model) -> Result<()> {
    let Some(found) = model
        .calibrate_moe_threshold(48)
        .context("calibrating the auto MoE threshold")?
    else {
        return Ok(());
    };
    let n = found.grouped_min_tokens;
    if found.cached {
        eprintln!("auto MoE threshold: grouped from {n} tokens (calibration cache)");
    } else {
        let table: Vec<String> = found
            .timings
            .iter()
            .map(|(t, p, g)| format!("{t}: {p:.3}/{g:.3}"))
            .collect();
        eprintln!(
            "auto MoE threshold: grouped from {n} tokens (measured per-token/grouped ms per MoE block: {})",
            table.join(", ")
        );
    }
    model.set_moe_strategy(MoeStrategy::Auto {
        grouped_min_tokens: n,
    });
    Ok(())
}
