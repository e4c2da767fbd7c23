//! Sessions on disk over the engine's caches: the [`SessionStore`] the KV manager writes
//! evicted (or, while idle, cached) prefixes to and restores prompts from. What a prefix adds
//! to the folder is copied off the device on the engine thread and written by a background
//! thread; a restore's files are read and checked on a thread of their own while the
//! sequence waits, then copied into its blocks (and state slot).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use corral_model::{BlockId, PagedKvCache, RecurrentStateCache, SlotId};

use crate::kv::{RestoreId, RestorePlan};
use crate::metrics::EngineMetrics;
use crate::{EngineError, EvictedPrefix, SessionStore, SpillDir, SpillFile, SpilledRun};

/// Blocks of a prompt that no later request took that are written when it is evicted: its
/// opening, where other prompts most often meet it again.
const OPENING_BLOCKS: usize = 2;

/// `dir`'s size and index in the metrics' gauges.
pub(crate) fn show_folder(metrics: &EngineMetrics, dir: &SpillDir) {
    metrics
        .session_dir_bytes
        .store(dir.bytes(), Ordering::Relaxed);
    metrics
        .session_index_blocks
        .store(dir.num_blocks() as u64, Ordering::Relaxed);
}

/// Restores under way, by id.
pub(crate) type Reads = HashMap<RestoreId, Restore>;

/// What a restore's reader gives: each file it read and checked, or the file at fault.
type ReadFiles = Result<Vec<(u32, SpillFile)>, (u32, EngineError)>;

/// The reads of a restore's files, with their milliseconds.
type SpillRead = std::thread::JoinHandle<(ReadFiles, f64)>;

/// A restore found for a prompt: its plan, the prompt's tokens it covers (each block's are
/// checked against the file's), and the read of its files on their own thread. Dropped
/// unjoined (the prompt went elsewhere), it tells the thread to stop reading.
pub(crate) struct Restore {
    plan: RestorePlan,
    tokens: Vec<u32>,
    reader: Option<SpillRead>,
    cancel: Arc<AtomicBool>,
}

impl Restore {
    fn start(
        plan: RestorePlan,
        tokens: Vec<u32>,
        files: Vec<(u32, std::path::PathBuf)>,
        fingerprint: u64,
    ) -> Option<Self> {
        let cancel = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&cancel);
        let reader = std::thread::Builder::new()
            .name("corral-restore".to_string())
            .spawn(move || read_files(&files, fingerprint, &flag))
            .ok()?;
        Some(Self {
            plan,
            tokens,
            reader: Some(reader),
            cancel,
        })
    }

    /// Whether the reads have ended (their result ready).
    fn is_finished(&self) -> bool {
        self.reader
            .as_ref()
            .is_none_or(std::thread::JoinHandle::is_finished)
    }

    /// The reads' result (waiting for it).
    fn join(&mut self) -> (ReadFiles, f64) {
        let first = self.plan.files().first().copied().unwrap_or(0);
        let failed = || {
            (
                first,
                EngineError::Spill {
                    path: std::path::PathBuf::new(),
                    detail: "its reader failed".to_string(),
                },
            )
        };
        match self.reader.take().map(std::thread::JoinHandle::join) {
            Some(Ok(read)) => read,
            _ => (Err(failed()), 0.0),
        }
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        if self.reader.is_some() {
            self.cancel.store(true, Ordering::Relaxed);
        }
    }
}

fn read_files(
    files: &[(u32, std::path::PathBuf)],
    fingerprint: u64,
    cancel: &AtomicBool,
) -> (ReadFiles, f64) {
    let start = std::time::Instant::now();
    let read = files
        .iter()
        .map(|(id, path)| {
            SpillFile::read_unless(path, fingerprint, cancel)
                .map(|f| (*id, f))
                .map_err(|e| (*id, e))
        })
        .collect();
    (read, start.elapsed().as_secs_f64() * 1e3)
}

/// Sessions on disk over the engine's caches (see [`SessionStore`]).
pub(crate) struct DiskSessions<'a> {
    pub(crate) backend: &'a dyn corral_backend::Backend,
    pub(crate) cache: &'a mut PagedKvCache,
    pub(crate) state: &'a mut RecurrentStateCache,
    pub(crate) dir: &'a mut SpillDir,
    pub(crate) hybrid: bool,
    pub(crate) metrics: &'a EngineMetrics,
    /// The restores `find` started, their files being read and checked by a thread while
    /// their sequence waits (and the eviction that makes room for it spills).
    pub(crate) reads: &'a mut Reads,
    /// The next restore's id.
    pub(crate) next_restore: &'a mut u64,
}

impl DiskSessions<'_> {
    fn show_folder(&self) {
        show_folder(self.metrics, self.dir);
    }

    /// Writes what the folder lacks of `prefix` (for a hybrid, only with the state at its
    /// end); `ahead`: the prefix stays cached (written while idle), and is written only if
    /// the folder has room without dropping another file.
    ///
    /// Evicted, what is likely to come back is written: a prefix at least half of which later
    /// requests took (a conversation that goes on, a prompt sessions share) whole; of one
    /// they took less of, only that part, and at least its opening ([`OPENING_BLOCKS`]: where
    /// other prompts meet it again, the chat template's start and a system prompt's); for a
    /// hybrid nothing then (blocks are of no use to it without the state at their end).
    /// While idle, everything.
    fn write_out(&mut self, prefix: &EvictedPrefix<'_>, ahead: bool) {
        if prefix.tokens.is_empty() || (self.hybrid && prefix.checkpoint.is_none()) {
            return;
        }
        let bs = self.cache.block_size.max(1);
        let keep = if ahead || 2 * prefix.reused >= prefix.tokens.len() {
            prefix.tokens.len()
        } else if self.hybrid {
            0
        } else {
            prefix
                .reused
                .max(OPENING_BLOCKS * bs)
                .min(prefix.tokens.len())
                / bs
                * bs
        };
        if keep == 0 {
            return;
        }
        let whole = keep == prefix.tokens.len();
        let Some(plan) = self
            .dir
            .plan_write(&prefix.tokens[..keep], self.hybrid && whole)
        else {
            return;
        };
        let blocks = &prefix.blocks[plan.first_block..plan.end.div_ceil(bs)];
        if ahead {
            let state = if plan.state {
                self.state.slot_bytes()
            } else {
                0
            };
            let bytes = blocks.len() * self.cache.block_bytes() + state;
            if !self.dir.has_room(bytes as u64) {
                return;
            }
        }
        let start = std::time::Instant::now();
        let written = (|| -> Result<(u64, f64), EngineError> {
            let buffers = self.dir.take_buffers();
            let kv = self.cache.read_blocks(self.backend, blocks, buffers)?;
            let state = match prefix.checkpoint {
                Some(slot) if plan.state => self.state.read_slot(self.backend, slot)?,
                _ => Vec::new(),
            };
            let copy_ms = start.elapsed().as_secs_f64() * 1e3;
            let bytes = self.dir.add(SpilledRun {
                fingerprint: self.dir.fingerprint(),
                parent: plan.parent,
                block_size: bs,
                tokens: prefix.tokens[plan.first_block * bs..plan.end].to_vec(),
                kv,
                state,
            })?;
            Ok((bytes, copy_ms))
        })();
        match written {
            Ok((bytes, copy_ms)) => {
                self.metrics.session_spills.fetch_add(1, Ordering::Relaxed);
                self.metrics
                    .session_spill_bytes
                    .fetch_add(bytes, Ordering::Relaxed);
                tracing::info!(
                    tokens = prefix.tokens.len(),
                    new_tokens = plan.end - plan.first_block * bs,
                    bytes,
                    copy_ms,
                    ms = start.elapsed().as_secs_f64() * 1e3,
                    "{}",
                    if ahead {
                        "wrote a cached prefix to disk while idle"
                    } else {
                        "spilled a cached prefix to disk"
                    }
                );
            }
            Err(e) => tracing::warn!(error = %e, "a cached prefix could not be spilled"),
        }
        self.show_folder();
    }

    /// Copies restore `restore`'s blocks into `blocks` and its state into `slot`, checking
    /// each block's tokens against the prompt's; the tokens and bytes restored and the
    /// milliseconds of the read, or the file at fault.
    fn load(
        &mut self,
        restore: &mut Restore,
        blocks: &[BlockId],
        slot: Option<SlotId>,
    ) -> Result<(usize, u64, f64), (Option<u32>, EngineError)> {
        let (files, read_ms) = restore.join();
        let files = files.map_err(|(f, e)| (Some(f), e))?;
        let bs = self.cache.block_size.max(1);
        let plan = &restore.plan;
        let fault = |file: Option<u32>, detail: String| {
            let path = file.map(|f| self.dir.path(f)).unwrap_or_default();
            (file, EngineError::Spill { path, detail })
        };
        if blocks.len() != plan.tokens.div_ceil(bs) || (slot.is_some() && plan.state.is_none()) {
            return Err(fault(
                None,
                format!(
                    "{} blocks asked of a restore of {} tokens",
                    blocks.len(),
                    plan.tokens
                ),
            ));
        }
        let file = |id: u32| files.iter().find(|f| f.0 == id).map(|f| &f.1);
        let mut bytes = 0u64;
        for piece in &plan.pieces {
            let Some(f) = file(piece.file) else {
                return Err(fault(Some(piece.file), "not read".to_string()));
            };
            let from = piece.first * bs;
            let to = ((piece.first + piece.count) * bs).min(f.tokens().len());
            let at = piece.at * bs;
            let want = restore.tokens.get(at..at + to.saturating_sub(from));
            if f.block_size() != bs || f.tokens().get(from..to) != want {
                return Err(fault(
                    Some(piece.file),
                    "its tokens are not the prompt's (a hash collision or a stale index)"
                        .to_string(),
                ));
            }
            let kv: Vec<(&[u8], &[u8])> = (0..f.layers())
                .map(|i| f.blocks(i, piece.first, piece.count))
                .collect();
            bytes += kv
                .iter()
                .map(|l| (l.0.len() + l.1.len()) as u64)
                .sum::<u64>();
            self.cache
                .write_blocks(self.backend, &blocks[piece.at..piece.at + piece.count], &kv)
                .map_err(|e| fault(Some(piece.file), e.to_string()))?;
        }
        if let (Some(slot), Some(id)) = (slot, plan.state) {
            let Some(f) = file(id).filter(|f| !f.state().is_empty()) else {
                return Err(fault(Some(id), "no recurrent state".to_string()));
            };
            bytes += f.state().len() as u64;
            self.state
                .write_slot(self.backend, slot, f.state())
                .map_err(|e| fault(Some(id), e.to_string()))?;
        }
        Ok((plan.tokens, bytes, read_ms))
    }
}

impl SessionStore for DiskSessions<'_> {
    fn spill(&mut self, prefix: &EvictedPrefix<'_>) {
        self.write_out(prefix, false);
    }

    fn write_ahead(&mut self, prefix: &EvictedPrefix<'_>) {
        self.write_out(prefix, true);
    }

    fn find(
        &mut self,
        tokens: &[u32],
        beyond: usize,
        max_tokens: usize,
    ) -> Option<(usize, RestoreId)> {
        let plan = self
            .dir
            .find(tokens, max_tokens, self.hybrid)
            .filter(|p| p.tokens > beyond)?;
        let files = plan.files();
        // A file whose write failed is gone (and forgotten): nothing to restore.
        if !files.iter().all(|&f| self.dir.finish_write(f)) {
            return None;
        }
        let paths = files.iter().map(|&f| (f, self.dir.path(f))).collect();
        let restore = Restore::start(
            plan.clone(),
            tokens[..plan.tokens].to_vec(),
            paths,
            self.dir.fingerprint(),
        )?;
        // Kept through the spills that make room for it, and until its restore ends.
        for &f in &files {
            self.dir.pin(f);
        }
        let id = RestoreId(*self.next_restore);
        *self.next_restore += 1;
        self.reads.insert(id, restore);
        Some((plan.tokens, id))
    }

    fn poll_load(
        &mut self,
        id: RestoreId,
        blocks: &[BlockId],
        slot: Option<SlotId>,
    ) -> Option<Result<(), String>> {
        if self.reads.get(&id).is_some_and(|r| !r.is_finished()) {
            return None;
        }
        let start = std::time::Instant::now();
        let Some(mut restore) = self.reads.remove(&id) else {
            return Some(Err("no such restore".to_string()));
        };
        let loaded = self.load(&mut restore, blocks, slot);
        let files = restore.plan.files();
        for &f in &files {
            self.dir.unpin(f);
        }
        let result = match loaded {
            Ok((tokens, bytes, read_ms)) => {
                for &f in &files {
                    self.dir.touch(f);
                }
                let m = self.metrics;
                m.session_restores.fetch_add(1, Ordering::Relaxed);
                m.session_restored_tokens
                    .fetch_add(tokens as u64, Ordering::Relaxed);
                m.session_restored_bytes.fetch_add(bytes, Ordering::Relaxed);
                tracing::info!(
                    tokens,
                    files = files.len(),
                    read_ms,
                    copy_ms = start.elapsed().as_secs_f64() * 1e3,
                    "restored a session from disk"
                );
                Ok(())
            }
            Err((file, e)) => {
                tracing::warn!(error = %e, "deleting a session file that could not be restored; recomputing");
                self.metrics
                    .session_restore_failures
                    .fetch_add(1, Ordering::Relaxed);
                if let Some(f) = file {
                    self.dir.remove(f);
                }
                Err(e.to_string())
            }
        };
        self.show_folder();
        Some(result)
    }

    fn keep_restores(&mut self, ids: &[RestoreId]) {
        let gone: Vec<RestoreId> = self
            .reads
            .keys()
            .filter(|id| !ids.contains(id))
            .copied()
            .collect();
        for id in gone {
            // Dropped unjoined: the reads stop.
            if let Some(restore) = self.reads.remove(&id) {
                for f in restore.plan.files() {
                    self.dir.unpin(f);
                }
            }
        }
    }
}
