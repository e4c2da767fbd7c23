//! The loopback collectives (staged through the host, for any backend): groups of ranks on
//! every backend this machine opens, and groups mixing the CPU with each, against the sums,
//! concatenations and copies made here; ranks that disagree, abort or pass bad buffers fail
//! every rank rather than leave one waiting.

use std::thread;

use corral_backend::{Backend, BackendError, Collective, DType, loopback_group};
use proptest::prelude::*;

use crate::{Rng, download, f32_buf, out_buf, subjects_and_staged_copies, u32_buf};

/// What a rank does in a test: a collective call on its backend.
type RankCall = fn(&dyn Collective, &'static dyn Backend) -> corral_backend::Result<()>;

/// `body` on a thread a rank of a loopback group over `backends`; the results in rank order.
fn on_ranks<T: Send>(
    backends: &[&'static dyn Backend],
    body: impl Fn(&dyn Collective, &'static dyn Backend) -> T + Sync,
) -> Vec<T> {
    let group = loopback_group(backends.to_vec());
    thread::scope(|s| {
        let ranks: Vec<_> = group
            .iter()
            .zip(backends)
            .map(|(c, &b)| {
                let body = &body;
                s.spawn(move || body(c, b))
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().expect("a rank panicked"))
            .collect()
    })
}

/// Groups of `world` ranks to test: each subject's backend for every rank, and the CPU's for
/// rank 0 with another subject's for the rest; named for the messages.
fn groups(world: usize) -> Vec<(String, Vec<&'static dyn Backend>)> {
    let subjects = subjects_and_staged_copies();
    let cpu = subjects[0].backend;
    let mut all = Vec::new();
    for s in &subjects {
        all.push((s.name.to_string(), vec![s.backend; world]));
        if world > 1 && s.name != "cpu" {
            let mut mixed = vec![s.backend; world];
            mixed[0] = cpu;
            all.push((format!("cpu and {}", s.name), mixed));
        }
    }
    all
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    #[test]
    fn loopback_collectives_sum_gather_and_copy(
        world in 1usize..5,
        len in 1usize..300,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        // Each rank's values, and a tail past `len` the collectives must leave alone.
        let parts: Vec<Vec<f32>> = (0..world).map(|_| rng.values(len + 3)).collect();
        let root = (seed % world as u64) as usize;
        let mut sum = vec![0.0f32; len];
        for part in &parts {
            sum.iter_mut().zip(part).for_each(|(s, v)| *s += v);
        }
        let gathered: Vec<f32> = parts.iter().flat_map(|p| p[..len].to_vec()).collect();
        for (name, backends) in groups(world) {
            let got = on_ranks(&backends, |c, b| {
                let own = &parts[c.rank()];
                let mut buf = f32_buf(b, own);
                c.all_reduce_sum(&mut buf, len).expect("all_reduce_sum");
                let reduced = download(b, &buf, len + 3);
                let mut all = out_buf(b, world * len);
                c.all_gather(&f32_buf(b, own), len, &mut all).expect("all_gather");
                let mut copied = f32_buf(b, own);
                c.broadcast(&mut copied, len, root).expect("broadcast");
                (reduced, download(b, &all, world * len), download(b, &copied, len + 3))
            });
            for (rank, (reduced, all, copied)) in got.into_iter().enumerate() {
                let tail = &parts[rank][len..];
                prop_assert_eq!(&reduced[..len], &sum[..], "{}: rank {} sum", name, rank);
                prop_assert_eq!(&reduced[len..], tail, "{}: rank {} sum's tail", name, rank);
                prop_assert_eq!(&all, &gathered, "{}: rank {} gather", name, rank);
                prop_assert_eq!(&copied[..len], &parts[root][..len], "{}: rank {} broadcast", name, rank);
                prop_assert_eq!(&copied[len..], tail, "{}: rank {} broadcast's tail", name, rank);
            }
        }
    }
}

/// Ranks entering different collectives (or one of another length) all fail, naming both.
#[test]
fn ranks_that_disagree_all_fail() {
    for (name, backends) in groups(3) {
        let got = on_ranks(&backends, |c, b| {
            let len = if c.rank() == 2 { 5 } else { 4 };
            let mut buf = f32_buf(b, &[1.0; 8]);
            c.all_reduce_sum(&mut buf, len)
        });
        for (rank, result) in got.into_iter().enumerate() {
            match result {
                Err(BackendError::BadArgument { op, detail }) => {
                    assert_eq!(op, "all_reduce_sum", "{name}: rank {rank}");
                    assert!(
                        detail.contains("AllReduceSum { len: 4 }")
                            && detail.contains("rank 2 AllReduceSum { len: 5 }"),
                        "{name}: rank {rank}: {detail}"
                    );
                }
                other => panic!("{name}: rank {rank}: {other:?}"),
            }
        }
    }
}

/// A rank's abort fails the ranks waiting in a collective and every later call; a rank's
/// refused buffer (or root) aborts the group too, rather than leaving its peers waiting.
#[test]
fn an_abort_or_a_refused_call_fails_every_rank() {
    for (name, backends) in groups(2) {
        let got = on_ranks(&backends, |c, b| {
            let mut buf = f32_buf(b, &[1.0; 4]);
            if c.rank() == 0 {
                c.abort();
            }
            let first = c.all_reduce_sum(&mut buf, 4);
            let later = c.broadcast(&mut buf, 4, 0);
            (first, later)
        });
        for (rank, (first, later)) in got.into_iter().enumerate() {
            for result in [first, later] {
                assert!(
                    matches!(&result, Err(BackendError::Device { detail, .. }) if detail.contains("aborted")),
                    "{name}: rank {rank}: {result:?}"
                );
            }
        }
        let refusals: [(&str, RankCall); 3] = [
            ("a u32 buffer", |c, b| {
                let mut words = u32_buf(b, &[1; 4]);
                c.all_reduce_sum(&mut words, 4)
            }),
            ("a short destination", |c, b| {
                let mut all = out_buf(b, 7);
                c.all_gather(&f32_buf(b, &[1.0; 4]), 4, &mut all)
            }),
            ("a root past the group", |c, b| {
                c.broadcast(&mut f32_buf(b, &[1.0; 4]), 4, 2)
            }),
        ];
        for (what, refused) in refusals {
            let got = on_ranks(&backends, |c, b| {
                if c.rank() == 1 {
                    refused(c, b)
                } else {
                    c.all_reduce_sum(&mut f32_buf(b, &[1.0; 4]), 4)
                }
            });
            match &got[1] {
                Err(BackendError::WrongDType {
                    got: DType::U32, ..
                })
                | Err(BackendError::TooSmall { .. })
                | Err(BackendError::BadArgument { .. }) => {}
                other => panic!("{name}: {what}: the refused rank: {other:?}"),
            }
            assert!(
                matches!(&got[0], Err(BackendError::Device { detail, .. }) if detail.contains("aborted")),
                "{name}: {what}: its peer: {:?}",
                got[0]
            );
        }
    }
}
