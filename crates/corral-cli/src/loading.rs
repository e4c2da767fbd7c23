//! Shared start-up of model commands: the thread pool, the backend, and loading weights with
//! a progress bar.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use corral_backend::CpuBackend;
use corral_model::Model;

/// Options every model-loading command takes.
#[derive(Debug, Args)]
pub(crate) struct ModelArgs {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files).
    #[arg(long, env = "CORRAL_MODEL")]
    pub(crate) model: PathBuf,
    /// CPU threads for compute (default: all cores).
    #[arg(long, env = "CORRAL_THREADS")]
    pub(crate) threads: Option<usize>,
}

/// Sizes the process-wide thread pool once.
pub(crate) fn init_threads(threads: Option<usize>) -> Result<()> {
    let threads = match threads {
        Some(0) => anyhow::bail!("--threads must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .context("starting the thread pool")
}

/// Loads the model of `args` on the CPU backend, with a progress bar on stderr.
pub(crate) fn load_model(args: &ModelArgs) -> Result<Model> {
    init_threads(args.threads)?;
    load_model_from(&args.model)
}

fn load_model_from(dir: &Path) -> Result<Model> {
    if !dir.is_dir() {
        anyhow::bail!("{}: not a directory", dir.display());
    }
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(dir.display().to_string());
    let backend = Arc::new(CpuBackend::new());
    let model = Model::load(dir, backend, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("loading model from {}", dir.display()));
    bar.finish_and_clear();
    model
}
