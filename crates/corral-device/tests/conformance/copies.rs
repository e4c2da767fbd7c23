//! Ops that move elements: gathers, the embedding lookup, copies within a buffer and of
//! whole KV blocks.

use corral_backend::{BufferUsage, DType, QuantFormat, WeightView, reference};
use proptest::prelude::*;

use crate::matmul::Format;
use crate::{Rng, assert_refused, download, f32_buf, out_buf, subjects_and_staged_copies, u32_buf};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn gathers_and_embeddings_copy_rows_exactly(
        table_rows in 1usize..40,
        dim_pairs in 1usize..100,
        tokens in 1usize..30,
        seed in any::<u64>(),
    ) {
        let dim = 2 * dim_pairs;
        let mut rng = Rng(seed);
        let table = crate::stored(DType::BF16, &rng.values(table_rows * dim));
        let ids: Vec<u32> = (0..tokens).map(|_| rng.below(table_rows) as u32).collect();
        let want = reference::gather_rows(&table, &ids, dim);
        for s in subjects_and_staged_copies() {
            let b = s.backend;
            let id_buf = u32_buf(b, &ids);
            let x = f32_buf(b, &table);
            let mut out = out_buf(b, tokens * dim);
            b.gather_rows(&x, &id_buf, tokens, dim, &mut out).unwrap();
            prop_assert_eq!(download(b, &out, tokens * dim), want.clone(), "{}: gather_rows", s.name);
            for dtype in [DType::F32, DType::BF16] {
                let w = b.weight_from_f32(&table, dtype).unwrap();
                let view = WeightView::new(&w, table_rows, dim).unwrap();
                let mut out = out_buf(b, tokens * dim);
                b.embedding(view, &id_buf, tokens, &mut out).unwrap();
                prop_assert_eq!(
                    download(b, &out, tokens * dim),
                    want.clone(),
                    "{}: embedding of a {} table",
                    s.name,
                    dtype
                );
            }
        }
    }

    #[test]
    fn copies_within_a_buffer_move_exactly_the_range(
        len in 2usize..200,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let v = rng.values(len);
        let count = 1 + rng.below(len / 2);
        let src = rng.below(len - 2 * count + 1);
        // A destination clear of the source range (src + count always is).
        let clear: Vec<usize> = (0..=len - count)
            .filter(|d| d.abs_diff(src) >= count)
            .collect();
        let dst = clear[rng.below(clear.len())];
        let mut want = v.clone();
        want.copy_within(src..src + count, dst);
        for s in subjects_and_staged_copies() {
            let b = s.backend;
            let mut buf = f32_buf(b, &v);
            b.copy_within(&mut buf, src, dst, count).unwrap();
            prop_assert_eq!(download(b, &buf, len), want.clone(), "{}: copy_within", s.name);
        }
    }
}

/// An id past the table (of floats, or of each block format the backend reads) or the rows
/// is refused (on a GPU, by the next read-back), as are outputs too short for the shape.
#[test]
fn gathers_and_embeddings_refuse_ids_out_of_range() {
    for s in subjects_and_staged_copies() {
        let b = s.backend;
        let ids = u32_buf(b, &[1, 5]);
        let table = b.weight_from_f32(&[0.0; 8], DType::F32).unwrap();
        let view = WeightView::new(&table, 2, 4).unwrap();
        let mut out = out_buf(b, 8);
        assert_refused(&s, "embedding", b.embedding(view, &ids, 2, &mut out));
        for format in QuantFormat::ALL {
            let hidden = 2 * format.block().0;
            let Some((table, _)) = Format::Blocks(format).weights(b, 3 * hidden, 1) else {
                continue;
            };
            let view = WeightView::new(&table, 3, hidden).unwrap();
            let mut out = out_buf(b, 2 * hidden);
            let past = b.embedding(view, &u32_buf(b, &[2, 3]), 2, &mut out);
            assert_refused(&s, "embedding", past);
        }
        let x = f32_buf(b, &[0.0; 8]);
        assert_refused(&s, "gather_rows", b.gather_rows(&x, &ids, 2, 4, &mut out));
        let mut short = out_buf(b, 7);
        let ok_ids = u32_buf(b, &[1, 0]);
        assert_refused(&s, "embedding", b.embedding(view, &ok_ids, 2, &mut short));
        assert_refused(
            &s,
            "gather_rows",
            b.gather_rows(&x, &ok_ids, 2, 4, &mut short),
        );
    }
}

#[test]
fn copies_within_move_16_bit_elements_and_refuse_bad_ranges() {
    for s in subjects_and_staged_copies() {
        let b = s.backend;
        let mut buf = b
            .take_buffer(DType::BF16, 12, BufferUsage::KvCache)
            .unwrap();
        let bytes: Vec<u8> = (1..=24).collect();
        b.write_bytes(&bytes, &mut buf, 0).unwrap();
        b.copy_within(&mut buf, 1, 8, 4).unwrap();
        let mut expected = bytes.clone();
        expected.copy_within(2..10, 16);
        for (src, dst, len) in [(0, 2, 4), (0, 10, 4), (usize::MAX, 0, 2)] {
            assert_refused(&s, "copy_within", b.copy_within(&mut buf, src, dst, len));
        }
        let mut out = vec![0u8; 24];
        b.read_bytes(&buf, 0, &mut out).unwrap();
        assert_eq!(out, expected, "{}: a refused copy changes nothing", s.name);
    }
}

/// Blocks gathered from a paged buffer land in order; scattered back into a zeroed buffer
/// they land at their ids and nowhere else; bad ids, types and sizes are refused.
#[test]
fn whole_blocks_gather_and_scatter_by_id() {
    let (blocks, n) = (6, 4);
    let paged: Vec<u8> = (0..blocks * n * 2).map(|i| (i * 5 % 251) as u8).collect();
    let ids = [4u32, 0, 5];
    let block = |id: u32| &paged[id as usize * n * 2..(id as usize + 1) * n * 2];
    for s in subjects_and_staged_copies() {
        let b = s.backend;
        let mut src = b
            .alloc_zeroed(DType::BF16, blocks * n, BufferUsage::KvCache)
            .unwrap();
        b.write_bytes(&paged, &mut src, 0).unwrap();
        let mut id_buf = u32_buf(b, &ids);
        let mut packed = b
            .alloc_zeroed(DType::BF16, 3 * n, BufferUsage::KvCache)
            .unwrap();
        b.gather_blocks(&src, &id_buf, 3, n, &mut packed).unwrap();
        let mut got = vec![0u8; 3 * n * 2];
        b.read_bytes(&packed, 0, &mut got).unwrap();
        assert_eq!(got, [block(4), block(0), block(5)].concat(), "{}", s.name);
        let mut dst = b
            .alloc_zeroed(DType::BF16, blocks * n, BufferUsage::KvCache)
            .unwrap();
        b.scatter_blocks(&packed, &id_buf, 3, n, &mut dst).unwrap();
        let mut back = vec![0u8; blocks * n * 2];
        b.read_bytes(&dst, 0, &mut back).unwrap();
        for id in 0..blocks as u32 {
            let want = if ids.contains(&id) {
                block(id).to_vec()
            } else {
                vec![0; n * 2]
            };
            assert_eq!(
                &back[id as usize * n * 2..(id as usize + 1) * n * 2],
                &want[..],
                "{}: block {id}",
                s.name
            );
        }
        let mut f32s = b
            .alloc_zeroed(DType::F32, 3 * n, BufferUsage::KvCache)
            .unwrap();
        assert_refused(
            &s,
            "gather_blocks",
            b.gather_blocks(&src, &id_buf, 3, n, &mut f32s),
        );
        assert_refused(
            &s,
            "gather_blocks",
            b.gather_blocks(&src, &id_buf, 4, n, &mut packed),
        );
        assert_refused(
            &s,
            "scatter_blocks",
            b.scatter_blocks(&packed, &id_buf, 3, 0, &mut dst),
        );
        b.upload_u32(&[4, 6, 0], &mut id_buf).unwrap();
        assert_refused(
            &s,
            "gather_blocks",
            b.gather_blocks(&src, &id_buf, 3, n, &mut packed),
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// An embedding table of any weight format the backend reads, rows of 1 to 8 blocks,
    /// gives each id's row exactly as the format stores it (block formats decoded bit for bit
    /// as the host decodes them).
    #[test]
    fn embeddings_read_every_weight_format_exactly(
        format in crate::matmul::formats(),
        vocab in 1usize..40,
        blocks in 1usize..9,
        tokens in 1usize..20,
        seed in any::<u64>(),
    ) {
        // Rows of 1 to 8 blocks (of 32 values for the float types).
        let hidden = blocks * match format {
            Format::Blocks(f) => f.block().0,
            Format::Float(_) => 32,
        };
        let mut rng = Rng(seed);
        let ids: Vec<u32> = (0..tokens).map(|_| rng.below(vocab) as u32).collect();
        for s in subjects_and_staged_copies() {
            let b = s.backend;
            let Some((table, values)) = format.weights(b, vocab * hidden, seed) else { continue };
            let want = reference::gather_rows(&values, &ids, hidden);
            let mut out = out_buf(b, tokens * hidden);
            let view = WeightView::new(&table, vocab, hidden).unwrap();
            b.embedding(view, &u32_buf(b, &ids), tokens, &mut out).unwrap();
            let got = download(b, &out, tokens * hidden);
            let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
            prop_assert!(same, "{}: {:?} embedding", s.name, format);
        }
    }
}
