//! Projections.

use corral_backend::{DType, WeightView, reference};
use proptest::prelude::*;

use crate::{Rng, assert_within, download, f32_buf, out_buf, subjects};

/// `v` as weights of `dtype` hold it.
fn stored(dtype: DType, v: &[f32]) -> Vec<f32> {
    match dtype {
        DType::BF16 => v
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect(),
        DType::F16 => v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
        _ => v.to_vec(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// `x · wᵀ` for float weights of each stored type, through a view that skips rows in
    /// front. A device that rounds projection inputs to 16 bits for 16-bit weights
    /// ([`Capabilities::bf16_projection_inputs`](corral_backend::Capabilities)) is held to
    /// what that rounding costs (1e-2 of the norm); the others to their own tolerance.
    #[test]
    fn matmul_matches_the_reference(
        m in 1usize..160,
        n in 1usize..90,
        k in 1usize..70,
        dtype in prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)],
        row_offset in 0usize..3,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let x = rng.values(m * k);
        let w_all = rng.values((n + row_offset) * k);
        let want = reference::matmul(&x, m, k, &stored(dtype, &w_all[row_offset * k..]), n);
        for s in subjects() {
            let b = s.backend;
            let w = b.weight_from_f32(&w_all, dtype).unwrap();
            let view = WeightView::new(&w, n + row_offset, k).unwrap().rows(row_offset, n).unwrap();
            let mut out = out_buf(b, m * n);
            b.matmul(&f32_buf(b, &x), m, view, &mut out).unwrap();
            let rounds = dtype != DType::F32 && b.capabilities().bf16_projection_inputs;
            let tol = if rounds { 1e-2 } else { 1e-6 };
            assert_within(&s, &format!("matmul, {dtype} weights"), &download(b, &out, m * n), &want, tol);
        }
    }
}
