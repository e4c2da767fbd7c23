//! Collectives: what the ranks of a model partitioned over several devices exchange (the
//! partial sums of a layer split by heads or experts, a vocabulary shard's logits). Each rank
//! holds a [`Collective`] bound to its own backend; every rank calls the same collectives in
//! the same order, and each call returns once every rank's part is in.
//!
//! [`loopback_group`] stages the exchange through host memory, for any backend: the ranks of
//! a test on one machine (CPU backends, or several ranks sharing one GPU), where no device
//! library connects the devices. A device library's group (NCCL) implements the same trait.

use std::ops::Deref;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use crate::checked::holds;
use crate::{Backend, BackendError, DType, DeviceBuffer, Result};

/// One rank's end of a group of devices that exchange buffers. The `*_unchecked` methods are
/// the implementation's; callers use the checked entries on `dyn Collective`.
pub trait Collective: Send + Sync {
    /// This rank's number, `0..world`.
    fn rank(&self) -> usize;

    /// How many ranks the group has.
    fn world(&self) -> usize;

    /// Sums the first `len` f32 values of `buf` over the ranks, in place: every rank ends
    /// with the same bits (the ranks' parts added in rank order).
    fn all_reduce_sum_unchecked(&self, buf: &mut DeviceBuffer, len: usize) -> Result<()>;

    /// Writes the first `len` f32 values of every rank's `src` to `dst`, rank after rank
    /// (`dst[r * len..(r + 1) * len]` is rank `r`'s).
    fn all_gather_unchecked(
        &self,
        src: &DeviceBuffer,
        len: usize,
        dst: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Copies the first `len` f32 values of rank `root`'s `buf` to every other rank's.
    fn broadcast_unchecked(&self, buf: &mut DeviceBuffer, len: usize, root: usize) -> Result<()>;

    /// Ends the group: every rank waiting in a collective, and every later call, fails
    /// (a rank that failed between collectives calls it, so that its peers do not wait for
    /// it forever).
    fn abort(&self);
}

impl<'c> dyn Collective + 'c {
    /// [`Collective::all_reduce_sum_unchecked`], its buffer checked.
    pub fn all_reduce_sum(&self, buf: &mut DeviceBuffer, len: usize) -> Result<()> {
        self.checked(holds("all_reduce_sum", "buf", buf, DType::F32, len))?;
        self.all_reduce_sum_unchecked(buf, len)
    }

    /// [`Collective::all_gather_unchecked`], its buffers checked.
    pub fn all_gather(&self, src: &DeviceBuffer, len: usize, dst: &mut DeviceBuffer) -> Result<()> {
        self.checked(
            holds("all_gather", "src", src, DType::F32, len)
                .and_then(|()| holds("all_gather", "dst", dst, DType::F32, len * self.world())),
        )?;
        self.all_gather_unchecked(src, len, dst)
    }

    /// [`Collective::broadcast_unchecked`], its buffer and root checked.
    pub fn broadcast(&self, buf: &mut DeviceBuffer, len: usize, root: usize) -> Result<()> {
        let root_in_group = if root < self.world() {
            Ok(())
        } else {
            Err(BackendError::BadArgument {
                op: "broadcast",
                detail: format!("root {root} of a group of {}", self.world()),
            })
        };
        self.checked(root_in_group.and_then(|()| holds("broadcast", "buf", buf, DType::F32, len)))?;
        self.broadcast_unchecked(buf, len, root)
    }

    /// A check's failure aborts the group: the other ranks would otherwise wait for this one.
    fn checked(&self, check: Result<()>) -> Result<()> {
        check.inspect_err(|_| self.abort())
    }
}

/// Which collective a rank entered, and with what: every rank must enter the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    AllReduceSum { len: usize },
    AllGather { len: usize },
    Broadcast { len: usize, root: usize },
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Self::AllReduceSum { .. } => "all_reduce_sum",
            Self::AllGather { .. } => "all_gather",
            Self::Broadcast { .. } => "broadcast",
        }
    }
}

/// A round of a loopback group: the parts of the ranks that have entered it, then its result.
#[derive(Default)]
struct Round {
    /// Rounds completed: a rank waits for this to pass the round it entered.
    completed: u64,
    parts: Vec<Option<(Call, Vec<f32>)>>,
    arrived: usize,
    /// The last round's result (or why it failed), kept until every rank has entered the next.
    result: Option<std::result::Result<Arc<Vec<f32>>, String>>,
    aborted: bool,
}

/// What the ranks of a loopback group share.
struct Meeting {
    world: usize,
    round: Mutex<Round>,
    done: Condvar,
}

impl Meeting {
    fn lock(&self) -> MutexGuard<'_, Round> {
        self.round.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Enters a round with this rank's `call` and `part`; returns the round's result once
    /// every rank has entered.
    fn meet(&self, rank: usize, call: Call, part: Vec<f32>) -> Result<Arc<Vec<f32>>> {
        let op = call.name();
        let aborted = || BackendError::Device {
            what: op.to_string(),
            detail: "the group was aborted (a rank failed)".to_string(),
        };
        let mut round = self.lock();
        if round.aborted {
            return Err(aborted());
        }
        let entered = round.completed;
        round.parts[rank] = Some((call, part));
        round.arrived += 1;
        if round.arrived == self.world {
            let parts: Vec<_> = round.parts.iter_mut().map(Option::take).collect();
            round.result = Some(combine(parts.into_iter().flatten().collect()).map(Arc::new));
            round.arrived = 0;
            round.completed += 1;
            self.done.notify_all();
        } else {
            while round.completed == entered && !round.aborted {
                round = self
                    .done
                    .wait(round)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            if round.completed == entered {
                return Err(aborted());
            }
        }
        match round.result.clone() {
            Some(Ok(values)) => Ok(values),
            Some(Err(detail)) => Err(BackendError::BadArgument { op, detail }),
            None => Err(aborted()),
        }
    }
}

/// The result of a round whose ranks' calls and parts are `parts`, in rank order; an error
/// where the ranks entered different collectives.
fn combine(parts: Vec<(Call, Vec<f32>)>) -> std::result::Result<Vec<f32>, String> {
    let first = parts[0].0;
    if let Some((rank, (call, _))) = parts.iter().enumerate().find(|(_, (c, _))| *c != first) {
        return Err(format!(
            "the ranks entered different collectives: rank 0 {first:?}, rank {rank} {call:?}"
        ));
    }
    Ok(match first {
        Call::AllReduceSum { len } => {
            let mut sum = vec![0.0f32; len];
            for (_, part) in &parts {
                sum.iter_mut().zip(part).for_each(|(s, v)| *s += v);
            }
            sum
        }
        Call::AllGather { .. } => parts.into_iter().flat_map(|(_, part)| part).collect(),
        Call::Broadcast { root, .. } => parts
            .into_iter()
            .nth(root)
            .map(|(_, p)| p)
            .unwrap_or_default(),
    })
}

/// One rank of a group staged through host memory ([`loopback_group`]): its part goes to the
/// host, the last rank to arrive combines the parts, and each rank copies the result back.
pub struct LoopbackCollective<B> {
    backend: B,
    rank: usize,
    meeting: Arc<Meeting>,
}

/// A group of `backends.len()` ranks exchanging through host memory, rank `r` on
/// `backends[r]` (any backends, the same one several times included).
pub fn loopback_group<B>(backends: Vec<B>) -> Vec<LoopbackCollective<B>>
where
    B: Deref<Target = dyn Backend> + Send + Sync,
{
    let world = backends.len();
    let meeting = Arc::new(Meeting {
        world,
        round: Mutex::new(Round {
            parts: vec![None; world],
            ..Round::default()
        }),
        done: Condvar::new(),
    });
    backends
        .into_iter()
        .enumerate()
        .map(|(rank, backend)| LoopbackCollective {
            backend,
            rank,
            meeting: Arc::clone(&meeting),
        })
        .collect()
}

impl<B> LoopbackCollective<B>
where
    B: Deref<Target = dyn Backend> + Send + Sync,
{
    /// The first `len` values of `buf`, on the host.
    fn part(&self, buf: &DeviceBuffer, len: usize) -> Result<Vec<f32>> {
        let mut part = vec![0.0; len];
        self.backend.download_f32(buf, &mut part)?;
        Ok(part)
    }

    /// Meets the other ranks; a failure of this rank's own copies aborts the group.
    fn round(&self, call: Call, part: Result<Vec<f32>>) -> Result<Arc<Vec<f32>>> {
        match part {
            Ok(part) => self.meeting.meet(self.rank, call, part),
            Err(e) => {
                self.abort();
                Err(e)
            }
        }
    }

    fn copy_back(&self, values: &[f32], dst: &mut DeviceBuffer) -> Result<()> {
        self.backend
            .upload_f32(values, dst)
            .inspect_err(|_| self.abort())
    }
}

impl<B> Collective for LoopbackCollective<B>
where
    B: Deref<Target = dyn Backend> + Send + Sync,
{
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.meeting.world
    }

    fn all_reduce_sum_unchecked(&self, buf: &mut DeviceBuffer, len: usize) -> Result<()> {
        let sum = self.round(Call::AllReduceSum { len }, self.part(buf, len))?;
        self.copy_back(&sum, buf)
    }

    fn all_gather_unchecked(
        &self,
        src: &DeviceBuffer,
        len: usize,
        dst: &mut DeviceBuffer,
    ) -> Result<()> {
        let all = self.round(Call::AllGather { len }, self.part(src, len))?;
        self.copy_back(&all, dst)
    }

    fn broadcast_unchecked(&self, buf: &mut DeviceBuffer, len: usize, root: usize) -> Result<()> {
        // Only the root's part is used; the others send none.
        let part = if self.rank == root {
            self.part(buf, len)
        } else {
            Ok(Vec::new())
        };
        let values = self.round(Call::Broadcast { len, root }, part)?;
        if self.rank == root {
            return Ok(());
        }
        self.copy_back(&values, buf)
    }

    fn abort(&self) {
        self.meeting.lock().aborted = true;
        self.meeting.done.notify_all();
    }
}
