//! `corral eval`: how well a model predicts a text file. Perplexity over windows of the
//! file's tokens, each window a fresh sequence (as transformers' sliding evaluation with no
//! overlap); with `--against`, a second configuration of the model (other weights, device,
//! KV type or strategy) run over the same windows, and the KL divergence of its next-token
//! distributions from the first's and how often their top tokens agree. With `--mtp N`, the
//! checkpoint's MTP head's top-1 agreement with the model's own top token at draft depths
//! 1..N, counted as the demo model's trainer counts it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;

use super::logits::sequence_logits;
use crate::loading::{ModelArgs, load_model};
use corral_engine::BLOCK_SIZE;
use corral_model::{
    BlockId, BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, SeqId, TokenId,
};

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
    /// Also score the checkpoint's MTP head at draft depths 1..N: how often its top token
    /// equals the model's own at the position it drafts for (depth k reads the text's token
    /// k on and, past depth 1, the head's own hidden state from the depth before).
    #[arg(long, default_value_t = 0)]
    mtp: usize,
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

/// The MTP head and what it agreed with, per depth `(same top token, positions)`.
struct MtpScore {
    head: Model,
    cache: PagedKvCache,
    table: BlockTable,
    depths: Vec<(usize, usize)>,
    /// Per-depth scratch: logits, the head's hidden states, the input hidden states.
    logits: Vec<f32>,
    out: Vec<f32>,
    input: Vec<f32>,
}

impl MtpScore {
    /// Loads the MTP head of `args`' checkpoint on `model`'s backend, with a KV cache for
    /// windows of `window` tokens.
    fn load(args: &EvalArgs, model: &Model) -> Result<Self> {
        let dir = args.model.dir().context("--mtp needs --model")?;
        let backend = model.backend().clone();
        let head = match args.model.gguf()? {
            Some(gguf) => Model::mtp_from_gguf(gguf, backend, &mut |_, _| {}),
            None => Model::load_mtp(dir, backend, &mut |_, _| {}),
        }
        .with_context(|| format!("loading the MTP head of {}", dir.display()))?;
        let blocks = args.window.div_ceil(BLOCK_SIZE);
        let cache = PagedKvCache::new(head.backend().as_ref(), head.config(), blocks, BLOCK_SIZE)?;
        let table = BlockTable {
            blocks: (0..blocks as u32).map(BlockId).collect(),
        };
        Ok(Self {
            head,
            cache,
            table,
            depths: vec![(0, 0); args.mtp],
            logits: Vec::new(),
            out: Vec::new(),
            input: Vec::new(),
        })
    }

    /// Scores one window: `inputs` its tokens, `hidden` the model's final hidden states at
    /// each, `greedy` the model's top token after each.
    fn add(&mut self, inputs: &[u32], hidden: &[f32], greedy: &[usize]) -> Result<()> {
        let (width, vocab) = (
            self.head.config().hidden_size,
            self.head.config().vocab_size,
        );
        self.input.clear();
        self.input.extend_from_slice(hidden);
        for (k, (same, count)) in (1..).zip(self.depths.iter_mut()) {
            if inputs.len() <= k {
                break;
            }
            let rows = inputs.len() - k;
            let tokens: Vec<TokenId> = inputs[k..].iter().map(|&t| TokenId(t)).collect();
            let mut batch = RaggedBatch::new(BLOCK_SIZE);
            batch.push_run(SeqId(0), &tokens, 0, &self.table, LogitsWanted::All)?;
            let _ = self.head.forward_mtp(
                &batch,
                &mut self.cache,
                &self.input[..rows * width],
                &mut self.logits,
                &mut self.out,
            )?;
            for (r, row) in self.logits.chunks_exact(vocab).enumerate() {
                *same += usize::from(argmax(row) == greedy[r + k]);
                *count += 1;
            }
            std::mem::swap(&mut self.input, &mut self.out);
        }
        Ok(())
    }

    /// Agreement per depth.
    fn agreement(&self) -> Vec<f64> {
        self.depths
            .iter()
            .map(|&(same, count)| same as f64 / count.max(1) as f64)
            .collect()
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
    let mut mtp = match args.mtp {
        0 => None,
        _ => Some(MtpScore::load(&args, &first)?),
    };
    let (mut a, mut b, mut hidden, mut greedy) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // One row's log-probabilities of each configuration, reused from row to row.
    let (mut la, mut lb) = (Vec::with_capacity(vocab), Vec::with_capacity(vocab));
    for start in (0..ids.len() - 1).step_by(args.window) {
        let end = (start + args.window).min(ids.len() - 1);
        let inputs = &ids[start..end];
        let targets = &ids[start + 1..=end];
        let wants_hidden = mtp.is_some().then_some(&mut hidden);
        sequence_logits(&first, inputs, inputs.len(), &mut a, wants_hidden)?;
        if let Some((_, model)) = &second {
            sequence_logits(model, inputs, inputs.len(), &mut b, None)?;
        }
        if let Some(mtp) = &mut mtp {
            greedy.clear();
            greedy.extend(a.chunks_exact(vocab).map(argmax));
            mtp.add(inputs, &hidden, &greedy)?;
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
        mtp.as_ref().map(MtpScore::agreement).as_deref(),
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

fn report(
    args: &EvalArgs,
    scores: &[Score; 2],
    against: Option<&str>,
    div: &Divergence,
    mtp: Option<&[f64]>,
) {
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
        if let Some(mtp) = mtp {
            value["mtp_top1"] = serde_json::json!(mtp);
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
    if let Some(mtp) = mtp {
        let depths: Vec<String> = mtp.iter().map(|a| format!("{:.2}%", 100.0 * a)).collect();
        println!(
            "MTP head's top-1 agreement with the model's top token, depths 1-{}: {}",
            mtp.len(),
            depths.join(", ")
        );
    }
}
