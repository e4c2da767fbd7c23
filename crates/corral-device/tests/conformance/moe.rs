//! MoE routing and the scatter back to token order.

use corral_backend::{BufferUsage, DType, reference};
use proptest::prelude::*;

use crate::{Rng, assert_near, assert_refused, download, f32_buf, out_buf, subjects, u32_buf};

#[test]
fn route_breaks_ties_to_the_lower_expert_and_renormalises() {
    for s in subjects() {
        let b = s.backend;
        // Token 0: experts 1 and 3 tie for first, 0 and 2 tie for last. Token 1: all equal.
        let logits = f32_buf(b, &[0.0, 2.0, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0]);
        let mut ids = b.take_buffer(DType::U32, 6, BufferUsage::Metadata).unwrap();
        let mut weights = b
            .take_buffer(DType::F32, 6, BufferUsage::Activations)
            .unwrap();
        for renormalize in [false, true] {
            b.moe_route(&logits, 2, 4, 3, renormalize, false, &mut ids, &mut weights)
                .unwrap();
            let mut got_ids = vec![0u32; 6];
            let mut got_w = vec![0f32; 6];
            b.download_u32(&ids, &mut got_ids).unwrap();
            b.download_f32(&weights, &mut got_w).unwrap();
            assert_eq!(got_ids, vec![1, 3, 0, 0, 1, 2]);
            let p_top = 2f32.exp() / (2.0 * 2f32.exp() + 2.0);
            let p_low = 1.0 / (2.0 * 2f32.exp() + 2.0);
            let expected: Vec<f32> = if renormalize {
                let sum = 2.0 * p_top + p_low;
                vec![
                    p_top / sum,
                    p_top / sum,
                    p_low / sum,
                    1.0 / 3.0,
                    1.0 / 3.0,
                    1.0 / 3.0,
                ]
            } else {
                vec![p_top, p_top, p_low, 0.25, 0.25, 0.25]
            };
            for (g, e) in got_w.iter().zip(&expected) {
                assert!(
                    ((g - e).abs() as f64) < 10.0 * s.tol,
                    "{}: {got_w:?} vs {expected:?}",
                    s.name
                );
            }
        }
    }
}

#[test]
fn route_with_a_shared_gate_adds_the_shared_expert_after_the_top_k() {
    for s in subjects() {
        let b = s.backend;
        // Two tokens of 3 experts and a shared gate logit each (the 4th column).
        let logits = f32_buf(b, &[3.0, 1.0, 2.0, 0.0, 0.5, 1.5, 1.0, -2.0]);
        let mut ids = b.take_buffer(DType::U32, 6, BufferUsage::Metadata).unwrap();
        let mut weights = b
            .take_buffer(DType::F32, 6, BufferUsage::Activations)
            .unwrap();
        b.moe_route(&logits, 2, 3, 2, true, true, &mut ids, &mut weights)
            .unwrap();
        let (mut got_ids, mut got_w) = (vec![0u32; 6], vec![0f32; 6]);
        b.download_u32(&ids, &mut got_ids).unwrap();
        b.download_f32(&weights, &mut got_w).unwrap();
        assert_eq!(got_ids, vec![0, 2, 3, 1, 2, 3]);
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        // The routed pair renormalised to 1; the shared expert weighted by its gate alone.
        let (a, c) = (3f32.exp(), 2f32.exp());
        let (d, e) = (1.5f32.exp(), 1f32.exp());
        let expected = [
            a / (a + c),
            c / (a + c),
            sigmoid(0.0),
            d / (d + e),
            e / (d + e),
            sigmoid(-2.0),
        ];
        for (g, w) in got_w.iter().zip(&expected) {
            assert!(
                ((g - w).abs() as f64) < 10.0 * s.tol,
                "{}: {got_w:?} vs {expected:?}",
                s.name
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn scale_scatter_add_adds_each_scaled_row_at_its_place(
        out_rows in 1usize..30,
        dim in 1usize..200,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        // Rows that do not repeat, a random subset in a random order.
        let mut rows: Vec<u32> = (0..out_rows as u32).collect();
        for i in (1..rows.len()).rev() {
            rows.swap(i, rng.below(i + 1));
        }
        rows.truncate(1 + rng.below(out_rows));
        let n = rows.len();
        let (y, scales, base) = (rng.values(n * dim), rng.values(n), rng.values(out_rows * dim));
        let want = reference::scale_scatter_add(&base, &y, &rows, &scales, dim);
        for s in subjects() {
            let b = s.backend;
            let mut out = f32_buf(b, &base);
            let (yb, rb, sb) = (f32_buf(b, &y), u32_buf(b, &rows), f32_buf(b, &scales));
            b.scale_scatter_add(&yb, &rb, &sb, n, dim, &mut out).unwrap();
            assert_near(&s, "scale_scatter_add", &download(b, &out, out_rows * dim), &want);
        }
    }
}

/// Top-k beyond the experts, too many experts, short buffers and rows out of range are
/// refused alike.
#[test]
fn routing_refuses_bad_shapes() {
    for s in subjects() {
        let b = s.backend;
        let logits = f32_buf(b, &[0.0; 16]);
        let mut ids = u32_buf(b, &[0; 8]);
        let mut weights = out_buf(b, 8);
        for (experts, top_k) in [(4, 0), (4, 5), (8192, 2)] {
            assert_refused(
                &s,
                "moe_route",
                b.moe_route(
                    &logits,
                    2,
                    experts,
                    top_k,
                    true,
                    false,
                    &mut ids,
                    &mut weights,
                ),
            );
        }
        assert_refused(
            &s,
            "moe_route",
            b.moe_route(&logits, 5, 4, 2, true, false, &mut ids, &mut weights),
        );
        let mut f32_ids = out_buf(b, 8);
        assert_refused(
            &s,
            "moe_route",
            b.moe_route(&logits, 2, 4, 2, true, false, &mut f32_ids, &mut weights),
        );
        let y = f32_buf(b, &[1.0; 8]);
        let far = u32_buf(b, &[0, 9]);
        let scales = f32_buf(b, &[1.0; 2]);
        let mut out = f32_buf(b, &[0.0; 16]);
        assert_refused(
            &s,
            "scale_scatter_add",
            b.scale_scatter_add(&y, &far, &scales, 2, 4, &mut out),
        );
        assert_refused(
            &s,
            "scale_scatter_add",
            b.scale_scatter_add(&y, &far, &scales, 3, 4, &mut out),
        );
    }
}
