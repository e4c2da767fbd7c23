//! Sampling where the logits are: the penalties and the reduction of each row to its
//! candidates, normalisers and Gumbel-max draw.

use corral_backend::sampling::{CANDIDATE_ROW_WORDS, Penalty, RowCandidates, RowDraw};
use corral_backend::{BufferUsage, DType, reference};
use proptest::prelude::*;

use crate::{Rng, assert_refused, download, f32_buf, out_buf, subjects, u32_buf};

/// Logits of a pattern: 0 random, 1 ties on a grid of quarters, 2 ascending, 3 sparse finite
/// values among -inf and NaN, 4 the first 16 of every 1,024 low (a GPU block's threshold then
/// passes more candidates than it holds).
fn logits(rng: &mut Rng, rows: usize, vocab: usize, pattern: u8) -> Vec<f32> {
    let mut logits = rng.values(rows * vocab);
    for (i, l) in logits.iter_mut().enumerate() {
        *l = match pattern {
            1 => (*l * 8.0).round() / 4.0,
            2 => (i % vocab) as f32 * 1e-3,
            3 => match rng.below(100) {
                0 => f32::NAN,
                1..=90 => f32::NEG_INFINITY,
                _ => *l * 10.0,
            },
            4 if i % 1024 < 16 => -5.0,
            _ => *l * 12.0,
        };
    }
    logits
}

/// The penalised logits bit for bit (any NaN as one), and each row's candidates, largest
/// logit and draw exactly and its normalisers within 1e-4, against the references, over
/// vocabularies of real models and rows of several temperatures with and without a draw.
/// A row may come back truncated (its best candidate alone sure) only where more
/// candidates pass a device's threshold than it holds.
#[test]
fn penalties_and_candidates_match_the_references() {
    let mut rng = Rng(71);
    let cases = [
        (1, 151_936, 0),
        (8, 151_936, 4),
        (2, 151_936, 1),
        (3, 50, 0),
        (2, 248_320, 3),
        (4, 4096, 2),
        (5, 1000, 1),
        (2, 248_320, 0),
        (300, 2000, 0),
    ];
    for (case, &(rows, vocab, pattern)) in cases.iter().enumerate() {
        let logits = logits(&mut rng, rows, vocab, pattern);
        let draws: Vec<RowDraw> = (0..rows)
            .map(|r| RowDraw {
                inv_temperature: [1.0, 1.7, 0.4][r % 3],
                gumbel_key: (r % 2 == 1).then(|| rng.next() << 20 | rng.next()),
            })
            .collect();
        let mut at: Vec<u32> = (0..(rows * vocab) as u32).collect();
        let penalties: Vec<Penalty> = (0..rows * 40)
            .map(|_| Penalty {
                index: at.swap_remove(rng.below(at.len())),
                subtract: rng.values(1)[0],
                repetition: 1.0 + rng.values(1)[0].abs(),
            })
            .collect();
        let penalised = reference::logit_penalties(&logits, &penalties);
        let entries: Vec<u32> = penalties.iter().flat_map(Penalty::words).collect();
        let draw_words: Vec<u32> = draws.iter().flat_map(RowDraw::words).collect();
        let bits = |v: &[f32]| {
            v.iter()
                .map(|l| if l.is_nan() { u32::MAX } else { l.to_bits() })
                .collect::<Vec<_>>()
        };
        for s in subjects() {
            let b = s.backend;
            let mut x = f32_buf(b, &logits);
            b.logit_penalties(&mut x, rows * vocab, &u32_buf(b, &entries), penalties.len())
                .unwrap();
            let got = download(b, &x, rows * vocab);
            assert!(
                bits(&got) == bits(&penalised),
                "{}: case {case}: penalised logits",
                s.name
            );
            let mut out = b
                .take_buffer(
                    DType::U32,
                    rows * CANDIDATE_ROW_WORDS,
                    BufferUsage::Metadata,
                )
                .unwrap();
            b.top_candidates(&x, rows, vocab, &u32_buf(b, &draw_words), &mut out)
                .unwrap();
            let mut words = vec![0; rows * CANDIDATE_ROW_WORDS];
            b.download_u32(&out, &mut words).unwrap();
            for (r, draw) in draws.iter().enumerate() {
                let what = format!("{}: case {case} row {r}", s.name);
                let row = &penalised[r * vocab..(r + 1) * vocab];
                let want = reference::top_candidates_row(row, *draw);
                let got = RowCandidates::from_words(
                    &words[r * CANDIDATE_ROW_WORDS..(r + 1) * CANDIDATE_ROW_WORDS],
                );
                if got.truncated {
                    assert_eq!(pattern, 4, "{what}: truncated");
                    assert_eq!(got.top[0], want.top[0], "{what}: best candidate");
                } else {
                    assert_eq!(got.top, want.top, "{what}: candidates");
                }
                assert_eq!(got.max.to_bits(), want.max.to_bits(), "{what}: max");
                assert_eq!(got.gumbel, want.gumbel, "{what}: Gumbel draw");
                for (name, a, b) in [
                    ("log-sum-exp", got.log_sum_exp, want.log_sum_exp),
                    (
                        "tempered",
                        got.tempered_log_sum_exp,
                        want.tempered_log_sum_exp,
                    ),
                ] {
                    let near = a == b || (a - b).abs() <= 1e-4 * b.abs().max(1.0);
                    assert!(near, "{what}: {name} {a} against {b}");
                }
            }
        }
    }
}

/// A penalty past the logits, a vocabulary of none or past what the reduction takes, and
/// short buffers or ones of the wrong type are refused alike.
#[test]
fn sampling_ops_refuse_bad_arguments() {
    for s in subjects() {
        let b = s.backend;
        let mut x = f32_buf(b, &[0.5; 64]);
        let far = Penalty {
            index: 64,
            subtract: 1.0,
            repetition: 1.0,
        };
        let entries = u32_buf(b, &far.words());
        let op = "logit_penalties";
        assert_refused(&s, op, b.logit_penalties(&mut x, 64, &entries, 1));
        assert_refused(&s, op, b.logit_penalties(&mut x, 65, &entries, 0));
        assert_refused(&s, op, b.logit_penalties(&mut x, 64, &entries, 2));
        let draw = u32_buf(
            b,
            &RowDraw {
                inv_temperature: 1.0,
                gumbel_key: None,
            }
            .words(),
        );
        let mut out = b
            .take_buffer(DType::U32, CANDIDATE_ROW_WORDS, BufferUsage::Metadata)
            .unwrap();
        let op = "top_candidates";
        assert_refused(&s, op, b.top_candidates(&x, 1, 0, &draw, &mut out));
        assert_refused(&s, op, b.top_candidates(&x, 2, 64, &draw, &mut out));
        let mut floats = out_buf(b, CANDIDATE_ROW_WORDS);
        assert_refused(&s, op, b.top_candidates(&x, 1, 64, &draw, &mut floats));
        let mut ids = u32_buf(b, &[0; 2]);
        let op = "argmax";
        assert_refused(&s, op, b.argmax(&x, 1, 0, &mut ids));
        assert_refused(&s, op, b.argmax(&x, 2, 33, &mut ids));
        assert_refused(&s, op, b.argmax(&x, 3, 8, &mut ids));
        assert_refused(&s, op, b.argmax(&x, 2, 8, &mut floats));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Each row's greedy token against the reference, over vocabularies from one logit to
    /// a real model's, logits of every pattern (ties, rows with no finite logit among NaN and
    /// -inf, ascending).
    #[test]
    fn argmax_matches_the_reference(
        rows in 1usize..6,
        vocab in prop_oneof![1usize..300, Just(151_936)],
        pattern in 0u8..5,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let mut logits = logits(&mut rng, rows, vocab, pattern);
        if pattern == 3 {
            // A row of no finite logit.
            logits[..vocab].fill(f32::NEG_INFINITY);
        }
        let want = reference::argmax(&logits, vocab);
        for s in subjects() {
            let b = s.backend;
            let mut ids = u32_buf(b, &vec![7; rows]);
            b.argmax(&f32_buf(b, &logits), rows, vocab, &mut ids).unwrap();
            let mut got = vec![0; rows];
            b.download_u32(&ids, &mut got).unwrap();
            prop_assert_eq!(&got, &want, "{}: {} rows of {}", s.name, rows, vocab);
        }
    }
}
