//! `corral bench`: measurements as commands, never as timed tests. Each subcommand interleaves
//! its variants within one run, so that they can be compared as ratios on a noisy machine.

pub(crate) mod decode;
mod grammar;
mod plot;
pub(crate) mod prefill;
pub(crate) mod serve;
pub(crate) mod sessions;
mod speculative;
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
    /// Decode steps over batch sizes and context lengths: ms per step, tok/s, launches,
    /// syncs, allocations and weight bytes per step.
    Decode(decode::DecodeArgs),
    /// Concurrency sweep against a running server: aggregate tok/s, TTFT and inter-token
    /// latency percentiles, errors.
    Serve(serve::ServeBenchArgs),
    /// Interleaved multi-turn agent sessions against a running server: per turn, TTFT of the
    /// re-sent conversation, cached prompt tokens, and TTFT of the turn's new text alone.
    Sessions(sessions::SessionsArgs),
    /// What constrained decoding (a JSON schema) costs a generated token: decode ms per
    /// token with and without it, mask time beside the forward and time waited for it.
    Grammar(grammar::GrammarArgs),
    /// Speculative decoding's variants on prompts cut from a text: draft tokens accepted (by
    /// position), tokens a step, decode tok/s against plain decoding, same tokens or not.
    Speculative(speculative::SpeculativeArgs),
}

/// The strategies named on a bench's command line, `auto` as the model was loaded with it (its
/// threshold measured on a GPU, or the given/default one).
pub(crate) fn named_strategies(
    names: &[String],
    model: &corral_model::Model,
) -> Result<Vec<(String, corral_model::MoeStrategy)>> {
    use corral_model::MoeStrategy;
    names
        .iter()
        .map(|name| {
            let strategy = match name.parse::<MoeStrategy>() {
                Ok(MoeStrategy::Auto { .. }) => match model.moe_strategy() {
                    auto @ MoeStrategy::Auto { .. } => auto,
                    _ => MoeStrategy::default(),
                },
                Ok(s) => s,
                Err(e) => anyhow::bail!("--strategies: {e}"),
            };
            Ok((name.clone(), strategy))
        })
        .collect()
}

/// Prints the device time per kernel of what ran since profiling was switched on.
pub(crate) fn print_kernel_profile(title: &str, model: &corral_model::Model) -> Result<()> {
    let times = model.backend().kernel_profile()?;
    if times.is_empty() {
        return Ok(());
    }
    let total: f64 = times.iter().map(|t| t.ms).sum();
    println!("kernel profile: {title} (device ms, one extra run with events around launches)");
    for t in &times {
        println!(
            "  {:<32} {:>6} launches {:>10.3} ms {:>5.1}%",
            t.name,
            t.launches,
            t.ms,
            t.ms / total * 100.0
        );
    }
    println!("  {:<32} {:>6}          {:>10.3} ms", "total", "", total);
    Ok(())
}

pub(crate) fn run(args: BenchArgs) -> Result<()> {
    match args.command {
        BenchCommand::Prefill(args) => prefill::run(args),
        BenchCommand::Decode(args) => decode::run(args),
        BenchCommand::Serve(args) => serve::run(args),
        BenchCommand::Sessions(args) => sessions::run(args),
        BenchCommand::Grammar(args) => grammar::run(args),
        BenchCommand::Speculative(args) => speculative::run(args),
    }
}
