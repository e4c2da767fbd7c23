//! `corral`: run, score and inspect Qwen3-MoE-family models.
//!
//! Every command that loads a model takes `--model DIR` (a Hugging Face checkpoint directory)
//! and `--threads N`. Errors print their full chain to stderr and exit with status 1; bad
//! command lines exit with status 2.

mod commands;
mod loading;
mod speculative;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Corral: an inference engine for mixture-of-experts language models.
#[derive(Debug, Parser)]
#[command(name = "corral", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the model over an OpenAI-compatible HTTP API with continuous batching.
    Serve(commands::serve::ServeArgs),
    /// Generate text from a prompt, streaming it to stdout; statistics go to stderr.
    Run(commands::run::RunArgs),
    /// Write the fp32 logits of every position of a token sequence to a safetensors file.
    Logits(commands::logits::LogitsArgs),
    /// Score a text file: perplexity, and against a second configuration the KL divergence
    /// and top-1 agreement of their next-token distributions.
    Eval(commands::eval::EvalArgs),
    /// Describe a checkpoint: architecture, parameters, weight and KV cache bytes.
    Inspect(commands::inspect::InspectArgs),
    /// Plan memory: what a context at a concurrency needs, whether it fits a budget, and the
    /// largest context and concurrency the budget allows.
    Plan(commands::plan::PlanArgs),
    /// Measure: prefill time to first token across prompt lengths and MoE strategies.
    Bench(commands::bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs go to stderr, filtered by RUST_LOG: the server's default is info, the other
    // commands' warn (their results are on stdout).
    let default_filter = match cli.command {
        Command::Serve(_) => "info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Serve(args) => commands::serve::run(args),
        Command::Run(args) => commands::run::run(args),
        Command::Logits(args) => commands::logits::run(args),
        Command::Eval(args) => commands::eval::run(args),
        Command::Inspect(args) => commands::inspect::run(args),
        Command::Plan(args) => commands::plan::run(args),
        Command::Bench(args) => commands::bench::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
