//! The Gated DeltaNet's ops against the token-by-token references, over batches of runs
//! that start fresh or continue from their slots' states, and their refusals.

use corral_backend::reference::{self, Run};
use corral_backend::{DType, DeltaNetShape, RecurrentRuns};
use proptest::prelude::*;

use crate::{
    Rng, Subject, assert_near, assert_refused, assert_within, download, f32_buf, out_buf, subjects,
    u32_buf,
};

/// Up to three runs covering `tokens` in order, in distinct slots of `slots`, some fresh.
fn runs_of(rng: &mut Rng, tokens: usize, slots: usize) -> Vec<Run> {
    let count = 1 + rng.below(3.min(tokens));
    let mut cuts: Vec<usize> = (1..tokens).collect();
    for i in (1..cuts.len()).rev() {
        cuts.swap(i, rng.below(i + 1));
    }
    let mut cuts: Vec<usize> = cuts.into_iter().take(count - 1).collect();
    cuts.sort_unstable();
    let mut slot_order: Vec<usize> = (0..slots).collect();
    for i in (1..slot_order.len()).rev() {
        slot_order.swap(i, rng.below(i + 1));
    }
    let bounds: Vec<usize> = std::iter::once(0).chain(cuts).chain([tokens]).collect();
    bounds
        .windows(2)
        .zip(slot_order)
        .map(|(w, slot)| Run {
            start: w[0],
            len: w[1] - w[0],
            slot,
            fresh: rng.below(2) == 0,
        })
        .collect()
}

/// The runs as the ops take them.
fn flat(runs: &[Run]) -> Vec<u32> {
    words_of(runs).concat()
}

/// Each run's `[start, len, slot, fresh]`.
fn words_of(runs: &[Run]) -> Vec<[u32; 4]> {
    runs.iter()
        .map(|r| {
            [
                r.start as u32,
                r.len as u32,
                r.slot as u32,
                u32::from(r.fresh),
            ]
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn the_gates_match_the_reference(tokens in 1usize..40, heads in 1usize..40, seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let (a, bv) = (rng.values(tokens * heads), rng.values(tokens * heads));
        let (a_log, dt_bias) = (rng.values(heads), rng.values(heads));
        let (want_g, want_beta) = reference::delta_net_gates(&a, &bv, &a_log, &dt_bias);
        for s in subjects() {
            let b = s.backend;
            let (al, dt) = (
                b.weight_from_f32(&a_log, DType::F32).unwrap(),
                b.weight_from_f32(&dt_bias, DType::F32).unwrap(),
            );
            let (mut g, mut beta) = (out_buf(b, tokens * heads), out_buf(b, tokens * heads));
            b.delta_net_gates(&f32_buf(b, &a), &f32_buf(b, &bv), &al, &dt, tokens, heads, &mut g, &mut beta)
                .unwrap();
            assert_near(&s, "delta_net_gates: g", &download(b, &g, tokens * heads), &want_g);
            assert_near(&s, "delta_net_gates: beta", &download(b, &beta, tokens * heads), &want_beta);
        }
    }

    #[test]
    fn the_convolution_matches_the_reference(
        tokens in 1usize..40,
        channels in 1usize..70,
        kernel in 2usize..5,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let slots = 4;
        let runs = runs_of(&mut rng, tokens, slots);
        let (x, w) = (rng.values(tokens * channels), rng.values(channels * kernel));
        let state0 = rng.values(slots * channels * (kernel - 1));
        let mut want_state = state0.clone();
        let want = reference::causal_conv1d(&x, &w, channels, kernel, &runs, &mut want_state);
        for s in subjects() {
            let b = s.backend;
            let runs_buf = u32_buf(b, &flat(&runs));
            let rr = RecurrentRuns {
                runs: &runs_buf,
                num_runs: runs.len(),
                max_run_tokens: runs.iter().map(|r| r.len).max().unwrap_or(1),
                kept: None,
            };
            let wb = b.weight_from_f32(&w, DType::F32).unwrap();
            let mut state = f32_buf(b, &state0);
            let mut out = out_buf(b, tokens * channels);
            b.causal_conv1d(&f32_buf(b, &x), &wb, channels, kernel, rr, &mut state, &mut out)
                .unwrap();
            assert_near(&s, "causal_conv1d", &download(b, &out, tokens * channels), &want);
            assert_near(&s, "causal_conv1d: the states", &download(b, &state, state0.len()), &want_state);
        }
    }

    #[test]
    fn the_delta_rule_matches_the_reference(
        tokens in 1usize..48,
        nk in 1usize..3,
        ratio in 1usize..3,
        dk_quarter in 1usize..9,
        dv_quarter in 1usize..9,
        seed in any::<u64>(),
    ) {
        let (nv, dk, dv) = (nk * ratio, 4 * dk_quarter, 4 * dv_quarter);
        let mut rng = Rng(seed);
        let slots = 4;
        let runs = runs_of(&mut rng, tokens, slots);
        let width = 2 * nk * dk + nv * dv;
        let qkv = rng.values(tokens * width);
        // Decays in (0, 1], write strengths in (0, 1).
        let g: Vec<f32> = rng.values(tokens * nv).iter().map(|v| -v.abs()).collect();
        let beta: Vec<f32> = rng.values(tokens * nv).iter().map(|v| 0.5 + 0.45 * v).collect();
        let state0: Vec<f32> = rng.values(slots * nv * dk * dv).iter().map(|v| 0.1 * v).collect();
        let mut want_state = state0.clone();
        let want = reference::gated_delta_rule(&qkv, &g, &beta, (nk, nv, dk, dv), &runs, &mut want_state);
        let shape = DeltaNetShape { num_key_heads: nk, num_value_heads: nv, key_dim: dk, value_dim: dv };
        for s in subjects() {
            let b = s.backend;
            let runs_buf = u32_buf(b, &flat(&runs));
            let rr = RecurrentRuns {
                runs: &runs_buf,
                num_runs: runs.len(),
                max_run_tokens: runs.iter().map(|r| r.len).max().unwrap_or(1),
                kept: None,
            };
            let mut state = f32_buf(b, &state0);
            let mut out = out_buf(b, tokens * nv * dv);
            b.gated_delta_rule(&f32_buf(b, &qkv), &f32_buf(b, &g), &f32_buf(b, &beta), shape, rr, &mut state, &mut out)
                .unwrap();
            let (tol, state_tol) = delta_tols(&s, runs.iter().map(|r| r.len).max().unwrap_or(1));
            assert_within(&s, "gated_delta_rule", &download(b, &out, tokens * nv * dv), &want, tol);
            assert_within(&s, "gated_delta_rule: the states", &download(b, &state, state0.len()), &want_state, state_tol);
        }
    }
}

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

/// The delta rule at the Qwen3.5 shape (16 key heads, 32 value heads, dims 128) over runs
/// of every length around a GPU's chunks of 64 tokens and past the chunks one launch holds,
/// and of 15 to 17 tokens (where a GPU turns to its chunked form), with live incoming
/// states: each run's output and state against the reference, the same runs fed one token a
/// step against the reference, and the two against each other (a backend's chunked form
/// against its recurrence). A chunked form sums in another order over thousands of tokens:
/// within the subject's recurrence bounds of each run's norm ([`delta_tols`]; CUDA's 1.5e-3
/// for the outputs, 2.5e-3 for the states), and one token a step within 1e-3 (or the
/// subject's bounds, if tighter).
#[test]
fn the_delta_rule_matches_the_reference_over_long_runs() {
    let (nk, nv, dk, dv) = (16, 32, 128, 128);
    let shape = DeltaNetShape {
        num_key_heads: nk,
        num_value_heads: nv,
        key_dim: dk,
        value_dim: dv,
    };
    let width = 2 * nk * dk + nv * dv;
    let mut rng = Rng(29);
    for lens in [vec![130, 1, 64, 7, 65, 200, 15, 16, 17], vec![3300, 20]] {
        let tokens: usize = lens.iter().sum();
        let slots = lens.len() + 1;
        let runs = in_order(&lens, slots);
        let qkv = rng.values(tokens * width);
        let (g, beta, state0) = delta_inputs(&mut rng, tokens * nv, slots * nv * dk * dv, 0.3);
        let mut want_state = state0.clone();
        let want =
            reference::gated_delta_rule(&qkv, &g, &beta, (nk, nv, dk, dv), &runs, &mut want_state);
        let longest = lens.iter().copied().max().unwrap_or(1);
        for s in subjects() {
            let b = s.backend;
            let (qkv_b, g_b, beta_b) = (f32_buf(b, &qkv), f32_buf(b, &g), f32_buf(b, &beta));
            let run_words = u32_buf(b, &flat(&runs));
            let whole = RecurrentRuns {
                runs: &run_words,
                num_runs: runs.len(),
                max_run_tokens: longest,
                kept: None,
            };
            let mut state = f32_buf(b, &state0);
            let mut out = out_buf(b, tokens * nv * dv);
            b.gated_delta_rule(&qkv_b, &g_b, &beta_b, shape, whole, &mut state, &mut out)
                .unwrap();
            let (whole_out, whole_state) = (
                download(b, &out, tokens * nv * dv),
                download(b, &state, state0.len()),
            );
            // Step t: token t of every run that long, each a one-token run in its slot.
            let mut state = f32_buf(b, &state0);
            let mut out = out_buf(b, tokens * nv * dv);
            for step in 0..longest {
                let step_runs: Vec<Run> = runs
                    .iter()
                    .filter(|r| r.len > step)
                    .map(|r| Run {
                        start: r.start + step,
                        len: 1,
                        slot: r.slot,
                        fresh: step == 0 && r.fresh,
                    })
                    .collect();
                let words = u32_buf(b, &flat(&step_runs));
                let one = RecurrentRuns {
                    runs: &words,
                    num_runs: step_runs.len(),
                    max_run_tokens: 1,
                    kept: None,
                };
                b.gated_delta_rule(&qkv_b, &g_b, &beta_b, shape, one, &mut state, &mut out)
                    .unwrap();
            }
            let (stepped_out, stepped_state) = (
                download(b, &out, tokens * nv * dv),
                download(b, &state, state0.len()),
            );
            let (out_tol, state_tol) = delta_tols(&s, longest);
            let (step_out_tol, step_state_tol) = delta_tols(&s, 1);
            // Each run on its own, so that a short run's error cannot hide in a long one's norm.
            for r in &runs {
                let what = format!("runs {lens:?}: the run of {} in slot {}", r.len, r.slot);
                let o = r.start * nv * dv..(r.start + r.len) * nv * dv;
                let st = r.slot * nv * dk * dv..(r.slot + 1) * nv * dk * dv;
                for (name, got, want, tol) in [
                    ("out", &whole_out[o.clone()], &want[o.clone()], out_tol),
                    (
                        "state",
                        &whole_state[st.clone()],
                        &want_state[st.clone()],
                        state_tol,
                    ),
                    (
                        "out, one token a step",
                        &stepped_out[o.clone()],
                        &want[o.clone()],
                        step_out_tol,
                    ),
                    (
                        "state, one token a step",
                        &stepped_state[st.clone()],
                        &want_state[st.clone()],
                        step_state_tol,
                    ),
                    (
                        "out, whole against one token a step",
                        &whole_out[o.clone()],
                        &stepped_out[o.clone()],
                        out_tol,
                    ),
                    (
                        "state, whole against one token a step",
                        &whole_state[st.clone()],
                        &stepped_state[st.clone()],
                        state_tol,
                    ),
                ] {
                    crate::assert_within(&s, &format!("{what}: {name}"), got, want, tol);
                }
            }
        }
    }
}

/// The states a run keeps after each of its tokens but the last (for a speculative verify to
/// continue from any accepted draft), in the slots `kept` names: the convolution's and the
/// delta rule's, each what the reference holds after that token, next to the runs' outputs
/// and final states; at the Qwen3.5 shape and smaller ones.
#[test]
fn kept_states_are_the_states_after_each_token() {
    let mut rng = Rng(29);
    for case in 0..6 {
        let lens: Vec<usize> = (0..1 + rng.below(4)).map(|_| 1 + rng.below(5)).collect();
        let tokens: usize = lens.iter().sum();
        let runs = in_order(&lens, lens.len());
        let (mut kept, mut next) = (Vec::new(), lens.len());
        for &len in &lens {
            kept.push(if len > 1 {
                next as u32
            } else {
                corral_backend::NO_KEPT_STATES
            });
            next += len.saturating_sub(1);
        }
        let slots = next;
        let (nk, nv, dk, dv) = if case == 0 {
            (16, 32, 128, 128)
        } else {
            let nk = 1 + rng.below(2);
            (
                nk,
                nk * (1 + rng.below(3)),
                [16, 32, 128][case % 3],
                [16, 64, 128][case % 3],
            )
        };
        let channels = 2 * nk * dk + nv * dv;
        let kernel = 4;
        let x = rng.values(tokens * channels);
        let w = rng.values(channels * kernel);
        let conv0 = rng.values(slots * channels * (kernel - 1));
        let qkv = rng.values(tokens * channels);
        let (g, beta, state0) = delta_inputs(&mut rng, tokens * nv, slots * nv * dk * dv, 0.5);
        // The reference a token at a time, each run's state copied to its next kept slot
        // after every token but its last.
        let (conv_slot, delta_slot) = (channels * (kernel - 1), nv * dk * dv);
        let (mut conv_state, mut state) = (conv0.clone(), state0.clone());
        let (mut conv_out, mut out) = (vec![0.0; x.len()], vec![0.0; tokens * nv * dv]);
        for (r, run) in runs.iter().enumerate() {
            for j in 0..run.len {
                let one = [Run {
                    start: run.start + j,
                    len: 1,
                    slot: run.slot,
                    fresh: run.fresh && j == 0,
                }];
                let o = reference::causal_conv1d(&x, &w, channels, kernel, &one, &mut conv_state);
                let t = run.start + j;
                conv_out[t * channels..(t + 1) * channels]
                    .copy_from_slice(&o[t * channels..(t + 1) * channels]);
                let o = reference::gated_delta_rule(
                    &qkv,
                    &g,
                    &beta,
                    (nk, nv, dk, dv),
                    &one,
                    &mut state,
                );
                out[t * nv * dv..(t + 1) * nv * dv]
                    .copy_from_slice(&o[t * nv * dv..(t + 1) * nv * dv]);
                if j + 1 < run.len {
                    let to = kept[r] as usize + j;
                    conv_state.copy_within(
                        run.slot * conv_slot..(run.slot + 1) * conv_slot,
                        to * conv_slot,
                    );
                    state.copy_within(
                        run.slot * delta_slot..(run.slot + 1) * delta_slot,
                        to * delta_slot,
                    );
                }
            }
        }
        let shape = DeltaNetShape {
            num_key_heads: nk,
            num_value_heads: nv,
            key_dim: dk,
            value_dim: dv,
        };
        let words = words_of(&runs);
        let what = format!("case {case}: runs {lens:?}, {nv}/{nk} heads of {dv}/{dk}");
        let want = [&conv_out[..], &conv_state, &out, &state];
        for s in subjects() {
            let got = crate::common::recurrence(
                s.backend,
                (&x, &w, kernel),
                (&qkv, &g, &beta),
                shape,
                &words,
                Some(&kept),
                (&conv0, &state0),
            );
            assert_recurrence(&s, &what, &got, want, delta_tols(&s, 1));
        }
    }
}

/// The convolution over 1 to 299 channels and the delta rule at the head dims where a GPU's
/// kernels change (every pair of key dims 16, 32 and 128 and value dims 16, 64 and 128;
/// value dims past 128, which take blocks of more than 256 threads; dims no multiple of 16),
/// from live states, against the references within [`delta_tols`]: at each, two runs long
/// enough for the chunked form, and three one-token runs (decode: a GPU's recurrence); and
/// three long runs at the Qwen3.5 dims.
#[test]
fn recurrent_ops_match_the_references_where_kernels_change() {
    let mut rng = Rng(13);
    let pairs = [16, 32, 128]
        .into_iter()
        .flat_map(|dk| [16, 64, 128].map(|dv| (dk, dv)))
        .chain([(16, 256), (16, 24), (24, 40), (72, 200)]);
    let mut cases = Vec::new();
    for dims in pairs {
        cases.push((dims, vec![70 + rng.below(60), 1 + rng.below(90)]));
        cases.push((dims, vec![1, 1, 1]));
    }
    cases.push(((128, 128), vec![45, 17, 90]));
    for (case, ((dk, dv), lens)) in cases.into_iter().enumerate() {
        let tokens: usize = lens.iter().sum();
        let slots = lens.len() + 2;
        let runs = in_order(&lens, slots);
        let longest = lens.iter().copied().max().unwrap_or(1);
        let (channels, kernel) = (1 + rng.below(299), 2 + rng.below(3));
        let x = rng.values(tokens * channels);
        let w = rng.values(channels * kernel);
        let conv0 = rng.values(slots * channels * (kernel - 1));
        let nk = 1 + rng.below(2);
        let nv = nk * (1 + rng.below(3));
        let qkv = rng.values(tokens * (2 * nk * dk + nv * dv));
        let (g, beta, state0) = delta_inputs(&mut rng, tokens * nv, slots * nv * dk * dv, 0.5);
        let (mut want_conv_state, mut want_state) = (conv0.clone(), state0.clone());
        let want_conv =
            reference::causal_conv1d(&x, &w, channels, kernel, &runs, &mut want_conv_state);
        let want =
            reference::gated_delta_rule(&qkv, &g, &beta, (nk, nv, dk, dv), &runs, &mut want_state);
        let shape = DeltaNetShape {
            num_key_heads: nk,
            num_value_heads: nv,
            key_dim: dk,
            value_dim: dv,
        };
        let words = words_of(&runs);
        let what = format!(
            "case {case}: runs {lens:?}, {channels} channels, kernel {kernel}, {nv}/{nk} heads of {dv}/{dk}"
        );
        let want = [&want_conv[..], &want_conv_state, &want, &want_state];
        for s in subjects() {
            let got = crate::common::recurrence(
                s.backend,
                (&x, &w, kernel),
                (&qkv, &g, &beta),
                shape,
                &words,
                None,
                (&conv0, &state0),
            );
            assert_recurrence(&s, &what, &got, want, delta_tols(&s, longest));
        }
    }
}

/// The bounds on the delta rule's outputs and states (relative to the reference's norm) of a
/// batch whose longest run has `longest` tokens: the subject's recurrence bounds, and 1e-3
/// where every run is shorter than the 16 tokens from which a GPU takes the chunked form
/// (its recurrence in f32 then).
fn delta_tols(s: &Subject, longest: usize) -> (f64, f64) {
    let (out, state) = (s.recurrence_out_tol, s.recurrence_state_tol);
    if longest < 16 {
        (out.min(1e-3), state.min(1e-3))
    } else {
        (out, state)
    }
}

/// Each of a recurrence's results (the convolution's output and states, the delta rule's)
/// within its tolerance of `want`: the convolution's 1e-5, the delta rule's `delta_tols`.
fn assert_recurrence(
    s: &crate::Subject,
    what: &str,
    got: &crate::common::Recurrence,
    want: [&[f32]; 4],
    delta_tols: (f64, f64),
) {
    let results = [
        ("conv out", &got.conv_out, 1e-5),
        ("conv states", &got.conv_state, 1e-5),
        ("delta out", &got.out, delta_tols.0),
        ("delta states", &got.state, delta_tols.1),
    ];
    for ((name, got, tol), want) in results.into_iter().zip(want) {
        crate::assert_within(s, &format!("{what}: {name}"), got, want, tol);
    }
}

/// Runs of `lens` tokens one after another, the first in the last of `slots` slots and each
/// next one slot lower, every other one starting fresh.
fn in_order(lens: &[usize], slots: usize) -> Vec<Run> {
    let starts = lens.iter().scan(0, |at, &len| {
        let start = *at;
        *at += len;
        Some(start)
    });
    starts
        .zip(lens)
        .enumerate()
        .map(|(i, (start, &len))| Run {
            start,
            len,
            slot: slots - 1 - i,
            fresh: i % 2 == 1,
        })
        .collect()
}

/// The delta rule's inputs from `rng`: `n` log-decays in `[−decay, 0]`, `n` write strengths
/// in `[0, 1)`, and a state pool of `state_len` values in `[−0.1, 0.1)`.
fn delta_inputs(
    rng: &mut Rng,
    n: usize,
    state_len: usize,
    decay: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let g = rng.values(n).iter().map(|v| -decay * v.abs()).collect();
    let beta = rng.values(n).iter().map(|v| 0.5 + 0.5 * v).collect();
    let state = rng.values(state_len).iter().map(|v| 0.1 * v).collect();
    (g, beta, state)
}
