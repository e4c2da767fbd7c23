//! `corral eval`: how well a model predicts a text file. Perplexity over windows of the
//! file's tokens, each window a fresh sequence (as transformers' sliding evaluation with no
//! overlap); with `--against`, a second configuration of the model (other weights, device,
//! KV type or strategy) run over the same windows, and the KL divergence of its next-token
//! distributions from the first's and how often their top tokens agree.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;

use super::logits::sequence_logits;
use crate::loading::{ModelArgs, load_model};

/// Arguments of `corral eval`.
#[derive(Debug, Args)]
pub(crate) struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text to score (UTF-8), tokenized whole by the model's tokenizer.
    #[arg(
        long,
        required_unless_present = "token_ids",
        conflicts_with = "token_ids"
    )]
    text: Option<PathBuf>,
    /// Or the token ids to score, comma-separated.
    #[arg(long, value_delimiter = ',')]
    token_ids: Vec<u32>,
    /// Tokens a window reads; each predicts the token after each of its positions.
    #[arg(long, default_value_t = 1024)]
    window: usize,
    /// Score at most this many tokens of the text (default: all of it).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// A second configuration to compare, as key=value pairs over the first's options:
    /// `model=PATH`, `device=cpu|cuda`, `kv-dtype=f32|bf16|fp8`, `moe-strategy=S`,
    /// `threads=N`; e.g. `--against model=demo.q8_0.gguf` or `--against device=cuda`.
    #[arg(long)]
    against: Option<String>,
    /// Print the results as one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// What a configuration scored over the text.
#[derive(Debug, Default)]
struct Score {
    /// Σ −log p(target) over the scored positions.
    nll: f64,
    /// Scored positions.
    count: usize,
}

impl Score {
    /// Counts one scored position of this negative log-probability.
    fn add(&mut self, nll: f64) {
        self.nll += nll;
        self.count += 1;
    }

    fn perplexity(&self) -> f64 {
        (self.nll / self.count.max(1) as f64).exp()
    }
}

/// How a second configuration's distributions differ from the first's.
#[derive(Debug, Default)]
struct Divergence {
    /// Σ KL(p_first ‖ p_second) over positions, in nats.
    kl: f64,
    /// The largest one position's KL.
    max_kl: f64,
    /// Positions whose most likely token is the same in both.
    top1_same: usize,
}

pub(crate) fn run(args: EvalArgs) -> Result<()> {
    if args.window < 2 {
        bail!("--window must be at least 2 tokens");
    }
    let mut ids = match &args.text {
        Some(path) => tokenize(&args.model, path)?,
        None => args.token_ids.clone(),
    };
    if let Some(max) = args.max_tokens {
        ids.truncate(max + 1);
    }
    if ids.len() < 2 {
        bail!("fewer than two tokens to score");
    }
    let first = load_model(&args.model)?;
    let second = match &args.against {
        Some(spec) => {
            let other = args.model.with_overrides(spec)?;
            let model = load_model(&other)?;
            if model.config().vocab_size != first.config().vocab_size {
                bail!(
                    "--against's vocabulary ({}) differs from the model's ({})",
                    model.config().vocab_size,
                    first.config().vocab_size
                );
            }
            Some((other.describe_run(), model))
        }
        None => None,
    };
    let vocab = first.config().vocab_size;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {bad} is outside the model's vocabulary of {vocab}");
    }
    let mut scores = [Score::default(), Score::default()];
    let mut divergence = Divergence::default();
    let windows = (ids.len() - 1).div_ceil(args.window);
    let bar = indicatif::ProgressBar::new(windows as u64).with_style(
        indicatif::ProgressStyle::with_template("scoring [{bar:30}] {pos}/{len} windows")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let (mut a, mut b) = (Vec::new(), Vec::new());
    // One row's log-probabilities of each configuration, reused from row to row.
    let (mut la, mut lb) = (Vec::with_capacity(vocab), Vec::with_capacity(vocab));
    for start in (0..ids.len() - 1).step_by(args.window) {
        let end = (start + args.window).min(ids.len() - 1);
        let inputs = &ids[start..end];
        let targets = &ids[start + 1..=end];
        sequence_logits(&first, inputs, inputs.len(), &mut a)?;
        if let Some((_, model)) = &second {
            sequence_logits(model, inputs, inputs.len(), &mut b)?;
        }
        for (k, &t) in targets.iter().enumerate() {
            let ra = &a[k * vocab..(k + 1) * vocab];
            if second.is_none() {
                scores[0].add(log_sum_exp(ra) - ra[t as usize] as f64);
                continue;
            }
            let rb = &b[k * vocab..(k + 1) * vocab];
            log_softmax_into(ra, &mut la);
            log_softmax_into(rb, &mut lb);
            scores[0].add(-la[t as usize]);
            scores[1].add(-lb[t as usize]);
            divergence.add(&la, &lb, argmax(ra) == argmax(rb));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    report(
        &args,
        &scores,
        second.as_ref().map(|(d, _)| d.as_str()),
        &divergence,
    );
    Ok(())
}

/// The token ids of the text file at `path`, by the model's tokenizer.
fn tokenize(model: &ModelArgs, path: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading {} as UTF-8 text", path.display()))?;
    let vocab_dir = model
        .dir()
        .context("scoring a text needs --model (a checkpoint or GGUF file with its tokenizer)")?;
    let (tokenizer, _) = model.vocabulary(vocab_dir)?;
    tokenizer
        .encode(&text)
        .with_context(|| format!("tokenizing {}", path.display()))
}

/// log Σ exp of one row, in f64.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    max + row
        .iter()
        .map(|&v| (v as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

/// log-softmax of one row, in f64, into `out`.
fn log_softmax_into(row: &[f32], out: &mut Vec<f64>) {
    let lse = log_sum_exp(row);
    out.clear();
    out.extend(row.iter().map(|&v| v as f64 - lse));
}

impl Divergence {
    /// Counts one position: the two configurations' log-probabilities and whether their top
    /// tokens agree.
    fn add(&mut self, first: &[f64], second: &[f64], same_top: bool) {
        let kl: f64 = first
            .iter()
            .zip(second)
            .map(|(&p, &q)| p.exp() * (p - q))
            .sum();
        let kl = kl.max(0.0);
        self.kl += kl;
        self.max_kl = self.max_kl.max(kl);
        self.top1_same += usize::from(same_top);
    }
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 { (i, v) } else { best }
        })
        .0
}

fn report(args: &EvalArgs, scores: &[Score; 2], against: Option<&str>, div: &Divergence) {
    let n = scores[0].count;
    let first = args.model.describe_run();
    let source = match &args.text {
        Some(path) => path.display().to_string(),
        None => "--token-ids".to_string(),
    };
    if args.json {
        let mut value = serde_json::json!({
            "text": source,
            "tokens": n,
            "window": args.window,
            "model": first,
            "perplexity": scores[0].perplexity(),
        });
        if let Some(other) = against {
            value["against"] = serde_json::json!({
                "model": other,
                "perplexity": scores[1].perplexity(),
                "kl_mean": div.kl / n.max(1) as f64,
                "kl_max": div.max_kl,
                "top1_agreement": div.top1_same as f64 / n.max(1) as f64,
            });
        }
        println!("{value}");
        return;
    }
    println!("{n} tokens of {source} in windows of {}", args.window);
    println!("{first}: perplexity {:.4}", scores[0].perplexity());
    if let Some(other) = against {
        println!("{other}: perplexity {:.4}", scores[1].perplexity());
        println!(
            "KL(first ‖ second) mean {:.6} nats (largest {:.4}), top-1 agreement {:.2}%",
            div.kl / n.max(1) as f64,
            div.max_kl,
            100.0 * div.top1_same as f64 / n.max(1) as f64
        );
    }
}
