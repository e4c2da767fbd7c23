//! Norms and elementwise ops.

use corral_backend::{DType, reference};
use proptest::prelude::*;

use crate::{Rng, assert_near, assert_refused, download, f32_buf, out_buf, subjects};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn norms_match_the_references(
        rows in 1usize..24,
        dim in 1usize..400,
        offset_one in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let (x, y, z, w) = (
            rng.values(rows * dim),
            rng.values(rows * dim),
            rng.values(rows * dim),
            rng.values(dim),
        );
        let eps = 1e-6;
        for s in subjects() {
            let b = s.backend;
            let (xb, zb) = (f32_buf(b, &x), f32_buf(b, &z));
            let wb = b.weight_from_f32(&w, DType::F32).unwrap();
            let mut out = out_buf(b, rows * dim);
            b.rms_norm(&xb, &wb, rows, dim, eps, offset_one, &mut out).unwrap();
            let want = reference::rms_norm(&x, &w, dim, eps, offset_one);
            assert_near(&s, "rms_norm", &download(b, &out, rows * dim), &want);

            let mut acc = f32_buf(b, &y);
            let mut out = out_buf(b, rows * dim);
            b.add_rms_norm(&mut acc, &xb, &wb, rows, dim, eps, offset_one, &mut out).unwrap();
            let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
            assert_near(&s, "add_rms_norm: the sum", &download(b, &acc, rows * dim), &sum);
            let want = reference::rms_norm(&sum, &w, dim, eps, offset_one);
            assert_near(&s, "add_rms_norm: the norm", &download(b, &out, rows * dim), &want);

            let mut out = out_buf(b, rows * dim);
            b.gated_rms_norm(&xb, &zb, &wb, rows, dim, eps, &mut out).unwrap();
            let want = reference::gated_rms_norm(&x, &z, &w, dim, eps);
            assert_near(&s, "gated_rms_norm", &download(b, &out, rows * dim), &want);
        }
    }

    #[test]
    fn elementwise_ops_match_the_references(
        rows in 1usize..24,
        dim in 1usize..300,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let len = rows * dim;
        let (x, y, gate) = (rng.values(len), rng.values(len), rng.values(rows));
        for s in subjects() {
            let b = s.backend;
            let (xb, yb, gb) = (f32_buf(b, &x), f32_buf(b, &y), f32_buf(b, &gate));
            let mut out = out_buf(b, len);
            b.silu_mul(&xb, &yb, len, &mut out).unwrap();
            assert_near(&s, "silu_mul", &download(b, &out, len), &reference::silu_mul(&x, &y));
            b.sigmoid_mul(&xb, &yb, len, &mut out).unwrap();
            assert_near(&s, "sigmoid_mul", &download(b, &out, len), &reference::sigmoid_mul(&x, &y));

            let mut acc = f32_buf(b, &y);
            b.add_in_place(&mut acc, &xb, len).unwrap();
            let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
            assert_near(&s, "add_in_place", &download(b, &acc, len), &sum);
            b.add_sigmoid_gated(&mut acc, &xb, &gb, rows, dim).unwrap();
            let want = reference::add_sigmoid_gated(&sum, &x, &gate, dim);
            assert_near(&s, "add_sigmoid_gated", &download(b, &acc, len), &want);

            // Zeroes the first `len - 1` elements and nothing after them.
            b.fill_zero(&mut acc, len - 1).unwrap();
            let mut want = vec![0.0; len - 1];
            want.push(download(b, &acc, len)[len - 1]);
            assert_eq!(download(b, &acc, len), want, "{}: fill_zero", s.name);
        }
    }
}

/// Every backend refuses a buffer of the wrong type or too short for the shape, naming the
/// op, and writes nothing.
#[test]
fn norms_and_elementwise_ops_refuse_bad_buffers() {
    let (rows, dim) = (3, 8);
    for s in subjects() {
        let b = s.backend;
        let x = f32_buf(b, &[0.5; 24]);
        let short = f32_buf(b, &[0.5; 23]);
        let w = b.weight_from_f32(&[1.0; 8], DType::F32).unwrap();
        let w16 = b.weight_from_f32(&[1.0; 8], DType::BF16).unwrap();
        let mut out = out_buf(b, 24);
        let mut acc = f32_buf(b, &[0.0; 24]);
        let mut ids = crate::u32_buf(b, &[0; 24]);
        assert_refused(
            &s,
            "rms_norm",
            b.rms_norm(&short, &w, rows, dim, 1e-6, false, &mut out),
        );
        assert_refused(
            &s,
            "rms_norm",
            b.rms_norm(&x, &w16, rows, dim, 1e-6, false, &mut out),
        );
        assert_refused(
            &s,
            "rms_norm",
            b.rms_norm(&x, &w, rows, dim, 1e-6, false, &mut ids),
        );
        assert_refused(
            &s,
            "add_rms_norm",
            b.add_rms_norm(&mut acc, &short, &w, rows, dim, 1e-6, false, &mut out),
        );
        assert_refused(
            &s,
            "gated_rms_norm",
            b.gated_rms_norm(&x, &short, &w, rows, dim, 1e-6, &mut out),
        );
        assert_refused(&s, "silu_mul", b.silu_mul(&x, &short, 24, &mut out));
        assert_refused(&s, "sigmoid_mul", b.sigmoid_mul(&x, &x, 24, &mut ids));
        assert_refused(&s, "add_in_place", b.add_in_place(&mut acc, &short, 24));
        assert_refused(
            &s,
            "add_sigmoid_gated",
            b.add_sigmoid_gated(&mut acc, &x, &short, 24, 1),
        );
        assert_refused(&s, "fill_zero", b.fill_zero(&mut ids, 24));
        assert!(
            download(b, &out, 24).iter().all(|v| v.is_nan()),
            "{}: a refused op wrote its output",
            s.name
        );
        assert_eq!(download(b, &acc, 24), vec![0.0; 24], "{}: acc", s.name);
    }
}
