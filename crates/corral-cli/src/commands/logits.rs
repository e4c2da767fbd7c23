//! `corral logits`: the fp32 logits of every position of a token sequence, fed through the
//! KV cache `--chunk` tokens at a time, written as safetensors tensor `logits` `[T, vocab]`.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use corral_engine::{BLOCK_SIZE, KvBlockPool};
use corral_model::{
    BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, RecurrentStateCache, SeqId, SlotId,
    TokenId,
};
use safetensors::tensor::{Dtype, TensorView};

use crate::loading::{ModelArgs, load_model};

/// Arguments of `corral logits`.
#[derive(Debug, Args)]
pub(crate) struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',', required = true)]
    token_ids: Vec<u32>,
    /// Output safetensors file.
    #[arg(long)]
    out: PathBuf,
    /// Tokens per forward pass (1 is pure decode); default: all at once.
    #[arg(long)]
    chunk: Option<usize>,
}

/// The logits of every position of `tokens` as one fresh sequence, fed `chunk` tokens a
/// forward through a paged KV cache of its own, into `all` (cleared first); with `hidden`,
/// also each position's final hidden state (after the final norm) into it.
pub(crate) fn sequence_logits(
    model: &Model,
    tokens: &[u32],
    chunk: usize,
    all: &mut Vec<f32>,
    mut hidden: Option<&mut Vec<f32>>,
) -> Result<()> {
    let blocks = tokens.len().div_ceil(BLOCK_SIZE);
    let mut pool = KvBlockPool::new(blocks, BLOCK_SIZE);
    let mut cache =
        PagedKvCache::new(model.backend().as_ref(), model.config(), blocks, BLOCK_SIZE)?;
    let mut state = RecurrentStateCache::new(model.backend().as_ref(), model.config(), 1)?;
    let mut table = BlockTable::default();
    pool.grow(&mut table, tokens.len())?;
    all.clear();
    if let Some(hidden) = hidden.as_deref_mut() {
        hidden.clear();
    }
    let (mut out, mut rows) = (Vec::new(), Vec::new());
    let chunk = chunk.max(1);
    for (i, piece) in tokens.chunks(chunk).enumerate() {
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        let ids: Vec<TokenId> = piece.iter().map(|&t| TokenId(t)).collect();
        batch.push_run(SeqId(0), &ids, i * chunk, &table, LogitsWanted::All)?;
        batch.set_state_slot(SeqId(0), SlotId(0))?;
        match hidden.as_deref_mut() {
            Some(hidden) => {
                let _ = model.forward_with_all_hidden(
                    &batch,
                    &mut cache,
                    Some(&mut state),
                    &mut out,
                    &mut rows,
                )?;
                hidden.extend_from_slice(&rows);
            }
            None => {
                let _ = model.forward_with_state(&batch, &mut cache, &mut state, &mut out)?;
            }
        }
        all.extend_from_slice(&out);
    }
    pool.release(&mut table);
    Ok(())
}

pub(crate) fn run(args: LogitsArgs) -> Result<()> {
    if args.chunk == Some(0) {
        bail!("--chunk must be at least 1");
    }
    let model = load_model(&args.model)?;
    let vocab = model.config().vocab_size;
    let tokens = &args.token_ids;
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary of {vocab}");
    }
    let chunk = args.chunk.unwrap_or(tokens.len());
    let mut all = Vec::with_capacity(tokens.len() * vocab);
    sequence_logits(&model, tokens, chunk, &mut all, None)?;
    let bytes: Vec<u8> = all.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(Dtype::F32, vec![tokens.len(), vocab], &bytes)
        .context("building the logits tensor")?;
    let metadata: Option<HashMap<String, String>> = None;
    safetensors::serialize_to_file([("logits", view)], &metadata, &args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "wrote logits [{}, {vocab}] to {}",
        tokens.len(),
        args.out.display()
    );
    Ok(())
}
