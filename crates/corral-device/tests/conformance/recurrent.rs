//! The Gated DeltaNet's ops: their refusals (their values are checked against the CPU in
//! `cuda_ops` until they have plain references here).

use corral_backend::{DType, DeltaNetShape, RecurrentRuns};

use crate::{assert_refused, download, f32_buf, out_buf, subjects, u32_buf};

/// Kernels and heads outside every backend's limits, and buffers of the wrong type or too
/// short, are refused alike, and nothing is written.
#[test]
fn recurrent_ops_refuse_bad_shapes() {
    for s in subjects() {
        let b = s.backend;
        let runs_buf = u32_buf(b, &[0, 2, 0, 1]);
        let f32_kept = f32_buf(b, &[0.0]);
        let runs = RecurrentRuns {
            runs: &runs_buf,
            num_runs: 1,
            max_run_tokens: 2,
            kept: None,
        };
        let (channels, tokens) = (4, 2);
        let x = f32_buf(b, &[0.5; 8]);
        let mut state = f32_buf(b, &[0.0; 64]);
        let mut out = out_buf(b, 64);
        for kernel in [1, 17] {
            let w = b
                .weight_from_f32(&vec![0.1; channels * kernel], DType::F32)
                .unwrap();
            assert_refused(
                &s,
                "causal_conv1d",
                b.causal_conv1d(&x, &w, channels, kernel, runs, &mut state, &mut out),
            );
        }
        let w = b.weight_from_f32(&[0.1; 16], DType::F32).unwrap();
        let short_runs = RecurrentRuns {
            num_runs: 2,
            ..runs
        };
        assert_refused(
            &s,
            "causal_conv1d",
            b.causal_conv1d(&x, &w, channels, 4, short_runs, &mut state, &mut out),
        );
        let kept_in_f32 = RecurrentRuns {
            kept: Some(&f32_kept),
            ..runs
        };
        assert_refused(
            &s,
            "causal_conv1d",
            b.causal_conv1d(&x, &w, channels, 4, kept_in_f32, &mut state, &mut out),
        );
        let w16 = b.weight_from_f32(&[0.1; 16], DType::BF16).unwrap();
        assert_refused(
            &s,
            "causal_conv1d",
            b.causal_conv1d(&x, &w16, channels, 4, runs, &mut state, &mut out),
        );

        let (a, gates) = (f32_buf(b, &[0.0; 8]), f32_buf(b, &[0.0; 3]));
        let (mut g, mut beta) = (out_buf(b, 8), out_buf(b, 8));
        assert_refused(
            &s,
            "delta_net_gates",
            b.delta_net_gates(&a, &a, &gates, &gates, tokens, 4, &mut g, &mut beta),
        );

        let qkv = f32_buf(b, &[0.1; 2 * (2 * 2 * 8 + 3 * 8)]);
        for (nk, nv, dk, dv) in [(2, 3, 8, 8), (0, 2, 8, 8), (1, 1, 129, 8), (1, 1, 8, 513)] {
            let shape = DeltaNetShape {
                num_key_heads: nk,
                num_value_heads: nv,
                key_dim: dk,
                value_dim: dv,
            };
            assert_refused(
                &s,
                "gated_delta_rule",
                b.gated_delta_rule(&qkv, &g, &beta, shape, runs, &mut state, &mut out),
            );
        }
        assert!(
            download(b, &out, 64).iter().all(|v| v.is_nan()),
            "{}: a refused op wrote its output",
            s.name
        );
        assert_eq!(download(b, &state, 64), vec![0.0; 64], "{}: state", s.name);
    }
}
