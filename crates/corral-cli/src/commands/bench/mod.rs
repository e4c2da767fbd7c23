//! `corral bench`: measurements as commands, never as timed tests. Each subcommand interleaves
//! its variants within one run, so that they can be compared as ratios on a noisy machine.

mod plot;
pub(crate) mod prefill;
pub(crate) mod serve;
mod summary;

use anyhow::Result;
use clap::{Args, Subcommand};

/// Arguments of `corral bench`.
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Time to first token over prompt lengths and MoE strategies, with dispatch counts and a
    /// linear fit of fixed cost and marginal rate.
    Prefill(prefill::PrefillArgs),
    /// Concurrency sweep against a running server: aggregate tok/s, TTFT and inter-token
    /// latency percentiles, errors.
    Serve(serve::ServeBenchArgs),
}

pub(crate) fn run(args: BenchArgs) -> Result<()> {
    match args.command {
        BenchCommand::Prefill(args) => prefill::run(args),
        BenchCommand::Serve(args) => serve::run(args),
    }
}
