//! A ragged batch computes each sequence exactly as if it ran alone, whatever mix of prefill
//! chunks and decode rows shares the step; and steady-state forwards allocate nothing.

use std::path::Path;
use std::sync::Arc;

use corral_cpu::CpuBackend;
use corral_model::{
    BlockId, BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, SeqId, TokenId,
};

const BLOCK_SIZE: usize = 4;

fn load(name: &str) -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    Model::load(&dir, Arc::new(CpuBackend::new()), &mut |_, _| {}).unwrap()
}

fn ids(tokens: &[u32]) -> Vec<TokenId> {
    tokens.iter().map(|&t| TokenId(t)).collect()
}

/// Logits of every token of `tokens` for one sequence alone, whole.
fn alone(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let blocks = tokens.len().div_ceil(BLOCK_SIZE);
    let mut cache =
        PagedKvCache::new(model.backend().as_ref(), model.config(), blocks, BLOCK_SIZE).unwrap();
    let table = BlockTable {
        blocks: (0..blocks as u32).map(BlockId).collect(),
    };
    let mut batch = RaggedBatch::new(BLOCK_SIZE);
    batch
        .push_run(SeqId(0), &ids(tokens), 0, &table, LogitsWanted::All)
        .unwrap();
    let mut out = Vec::new();
    let _ = model.forward(&batch, &mut cache, &mut out).unwrap();
    out
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

#[test]
fn mixed_prefill_and_decode_rows_match_each_sequence_alone() {
    for name in ["qwen3_moe_fused", "qwen3_moe_per_expert"] {
        let model = load(name);
        let vocab = model.config().vocab_size;
        let a: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % vocab as u32).collect();
        let b: Vec<u32> = (0..9).map(|i| (i * 53 + 2) % vocab as u32).collect();
        let (ref_a, ref_b) = (alone(&model, &a), alone(&model, &b));

        // Interleaved, non-contiguous blocks for the two sequences in one shared cache.
        let mut cache =
            PagedKvCache::new(model.backend().as_ref(), model.config(), 8, BLOCK_SIZE).unwrap();
        let table_a = BlockTable {
            blocks: [6, 1, 4].map(BlockId).to_vec(),
        };
        let table_b = BlockTable {
            blocks: [0, 7, 2].map(BlockId).to_vec(),
        };
        let mut got_a = Vec::new();
        let mut got_b = Vec::new();
        let mut out = Vec::new();
        // Step 1: a's first 6 tokens (prefill chunk) with b's first 2.
        // Step 2: a's next 4 with b's next 6. Steps 3: a's last token (decode) with b's last (decode).
        let plan: [(usize, usize, usize, usize); 3] = [(0, 6, 0, 2), (6, 10, 2, 8), (10, 11, 8, 9)];
        for (a0, a1, b0, b1) in plan {
            let mut batch = RaggedBatch::new(BLOCK_SIZE);
            batch
                .push_run(SeqId(1), &ids(&a[a0..a1]), a0, &table_a, LogitsWanted::All)
                .unwrap();
            batch
                .push_run(SeqId(2), &ids(&b[b0..b1]), b0, &table_b, LogitsWanted::All)
                .unwrap();
            let _ = model.forward(&batch, &mut cache, &mut out).unwrap();
            let split = (a1 - a0) * vocab;
            got_a.extend_from_slice(&out[..split]);
            got_b.extend_from_slice(&out[split..]);
        }
        assert!(
            max_rel(&got_a, &ref_a) < 1e-5,
            "{name} sequence a: {}",
            max_rel(&got_a, &ref_a)
        );
        assert!(
            max_rel(&got_b, &ref_b) < 1e-5,
            "{name} sequence b: {}",
            max_rel(&got_b, &ref_b)
        );
    }
}

#[test]
fn steady_state_forwards_allocate_nothing_and_sync_once() {
    let model = load("qwen3_moe_fused");
    let mut cache =
        PagedKvCache::new(model.backend().as_ref(), model.config(), 4, BLOCK_SIZE).unwrap();
    let table = BlockTable {
        blocks: (0..4).map(BlockId).collect(),
    };
    let mut out = Vec::new();
    let mut batch = RaggedBatch::new(BLOCK_SIZE);
    batch
        .push_run(
            SeqId(0),
            &ids(&[1, 2, 3, 4, 5]),
            0,
            &table,
            LogitsWanted::Last,
        )
        .unwrap();
    let _ = model.forward(&batch, &mut cache, &mut out).unwrap();
    for position in 5..10 {
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        batch
            .push_run(SeqId(0), &ids(&[7]), position, &table, LogitsWanted::Last)
            .unwrap();
        let report = model.forward(&batch, &mut cache, &mut out).unwrap();
        assert_eq!(
            report.stats.allocations, 0,
            "decode at {position} allocated"
        );
        assert_eq!(report.stats.host_syncs, 1, "only the logits read-back");
        assert!(report.stats.dispatches > 0);
    }
}

#[test]
fn invalid_batches_are_rejected() {
    let model = load("qwen3_moe_fused");
    let mut cache =
        PagedKvCache::new(model.backend().as_ref(), model.config(), 2, BLOCK_SIZE).unwrap();
    let mut out = Vec::new();
    let short = BlockTable {
        blocks: vec![BlockId(0)],
    };
    let mut batch = RaggedBatch::new(BLOCK_SIZE);
    let err = batch
        .push_run(SeqId(0), &ids(&[1; 5]), 0, &short, LogitsWanted::Last)
        .unwrap_err();
    assert!(err.to_string().contains("blocks hold 4"), "{err}");
    let beyond = BlockTable {
        blocks: vec![BlockId(9)],
    };
    batch
        .push_run(SeqId(0), &ids(&[1]), 0, &beyond, LogitsWanted::Last)
        .unwrap();
    let err = model.forward(&batch, &mut cache, &mut out).unwrap_err();
    assert!(err.to_string().contains("beyond the cache"), "{err}");
    let mut batch = RaggedBatch::new(BLOCK_SIZE);
    let ok = BlockTable {
        blocks: vec![BlockId(0)],
    };
    batch
        .push_run(SeqId(0), &ids(&[100_000]), 0, &ok, LogitsWanted::Last)
        .unwrap();
    let err = model.forward(&batch, &mut cache, &mut out).unwrap_err();
    assert!(err.to_string().contains("100000"), "{err}");
}

/// A KV cache with fewer layers than the model is an error, not layers silently skipped.
#[test]
fn a_cache_with_fewer_layers_than_the_model_is_refused() {
    let model = load("qwen3_moe_fused");
    let mut short = model.config().clone();
    short.num_layers -= 1;
    let mut cache = PagedKvCache::new(model.backend().as_ref(), &short, 2, BLOCK_SIZE).unwrap();
    let table = BlockTable {
        blocks: vec![BlockId(0), BlockId(1)],
    };
    let mut batch = RaggedBatch::new(BLOCK_SIZE);
    batch
        .push_run(SeqId(0), &ids(&[1, 2, 3]), 0, &table, LogitsWanted::Last)
        .unwrap();
    let err = model
        .forward(&batch, &mut cache, &mut Vec::new())
        .unwrap_err();
    assert!(err.to_string().contains("attention layers"), "{err}");
}

/// A session's KV blocks read off the cache and written into other blocks come back byte for
/// byte, whole or in pieces of two blocks (the pieces bound the device memory a copy needs),
/// and the blocks not written stay as they were.
#[test]
fn session_blocks_read_and_written_in_pieces_round_trip() {
    let model = load("qwen3_moe_fused");
    let backend = model.backend().as_ref();
    let config = model.config();
    let mut source = PagedKvCache::new(backend, config, 12, BLOCK_SIZE).unwrap();
    let tokens: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 50).collect();
    let table = BlockTable {
        blocks: [9, 2, 5, 11, 0, 7, 3, 8, 1, 6].map(BlockId).to_vec(),
    };
    let mut batch = RaggedBatch::new(BLOCK_SIZE);
    batch
        .push_run(SeqId(0), &ids(&tokens), 0, &table, LogitsWanted::Last)
        .unwrap();
    let _ = model.forward(&batch, &mut source, &mut Vec::new()).unwrap();
    let read = &table.blocks[..7];
    let whole = source.read_blocks(backend, read, Vec::new()).unwrap();
    let block_bytes = whole[0].len() / (2 * read.len());
    let pieced = PagedKvCache::new(backend, config, 12, BLOCK_SIZE)
        .unwrap()
        .with_copy_piece_bytes(2 * block_bytes);
    // Buffers of another size to read into: overwritten, cut and grown.
    let reuse = vec![vec![0xab; 5], vec![0xcd; whole[1].len() + 9]];
    let again = source.read_blocks(backend, read, reuse).unwrap();
    assert_eq!(again, whole);
    let mut target = pieced;
    let into = [4, 10, 0, 3, 7, 1, 8].map(BlockId);
    let layers: Vec<(&[u8], &[u8])> = whole.iter().map(|l| l.split_at(l.len() / 2)).collect();
    target.write_blocks(backend, &into, &layers).unwrap();
    let target = target.with_copy_piece_bytes(3 * block_bytes);
    let back = target.read_blocks(backend, &into, Vec::new()).unwrap();
    assert_eq!(back, whole);
    let untouched = target.read_blocks(backend, &[BlockId(2), BlockId(11)], Vec::new());
    assert!(untouched.unwrap().iter().flatten().all(|&b| b == 0));
}
