//! Sessions on disk: KV blocks and recurrent-state checkpoints written once, addressed by
//! their prefix.
//!
//! Every whole block is known by the chain hash of all tokens up to its end
//! ([`ChainHash`]), a state checkpoint by the chain hash of the tokens it follows. A prefix
//! shown to the folder is written as one file holding only the blocks the folder lacks (a
//! *run*, see [`file`]): sessions sharing a system prompt share its blocks on disk as they
//! do in memory, and a history that grew by a turn adds a file of that turn's blocks. A
//! restore gathers the longest chain of blocks of a prompt from however many files hold
//! them (and, for hybrid models, the deepest checkpoint at whose end all of them are); each
//! block's token ids, stored beside it, are checked against the prompt, so a hash collision
//! can cost a restore but never return the wrong KV.
//!
//! The index in memory holds hashes, never token ids: about [`INDEX_BYTES_PER_BLOCK`] bytes
//! a block and a little more a file, at most [`SpillDir::max_index_bytes`] under the
//! folder's byte cap, which the memory plan counts. Past the cap
//! the least recently used file goes first (a restore or a write that reuses a file's blocks
//! marks it used), never one being restored from.

mod file;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use file::{SpillFile, SpilledRun, fingerprint};

use crate::EngineError;

/// Bytes of finished writes' buffers kept for the next spill.
const SPARE_BYTES: usize = 2 << 30;

/// Bytes the index spends on one block at most: its map entry (key, file, place, the map's
/// control byte, load factor and doubling) and its key in its file's list.
const INDEX_BYTES_PER_BLOCK: usize = 48;

/// Bytes the index spends on one file at most: its entry in the map of files (its list's
/// header, state key, size and age) and in the map of states.
const INDEX_BYTES_PER_FILE: usize = 160;

/// The chain hash of a token sequence: each token's hash folded into the hash of the tokens
/// before it, so that equal hashes mean equal prefixes (up to a 2⁻⁶⁴ collision, which the
/// stored token ids catch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChainHash(pub u64);

impl ChainHash {
    /// The hash of no tokens.
    pub const START: Self = Self(0x243f_6a88_85a3_08d3);

    /// The hash of the tokens so far followed by `token`.
    pub fn then(self, token: u32) -> Self {
        Self(mix(self.0 ^ mix(u64::from(token) ^ 0x9e37_79b9_7f4a_7c15)))
    }

    /// The hash after each of `tokens` in turn, starting from `self`.
    pub fn along(self, tokens: &[u32]) -> impl Iterator<Item = Self> + '_ {
        tokens.iter().scan(self, |h, &t| {
            *h = h.then(t);
            Some(*h)
        })
    }
}

/// SplitMix64's finaliser: every input bit moves every output bit.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A file of the folder, by number.
type FileId = u32;

/// What the index knows of one file.
#[derive(Debug)]
struct RunMeta {
    /// The keys of the whole blocks it holds, in order.
    blocks: Vec<u64>,
    /// The key of the state checkpoint at its end, if it holds one.
    state: Option<u64>,
    bytes: u64,
    last_used: u64,
}

/// Where a block lies: its file and its place among the file's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BlockAt {
    file: FileId,
    index: u32,
}

/// What to write of a prefix: the run after its first `first_block` blocks (those are on
/// disk), made by [`SpillDir::plan_write`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritePlan {
    /// Blocks of the prefix the folder holds already, before the run.
    pub first_block: usize,
    /// Tokens of the prefix the run ends at (its last block may be partly filled only where a
    /// state follows).
    pub end: usize,
    /// The chain hash of the tokens before the run.
    pub parent: u64,
    /// Whether the run carries the recurrent state at its end.
    pub state: bool,
}

/// Blocks of a restore taken from one file: its `count` blocks from `first` go to the
/// prompt's blocks from `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestorePiece {
    /// The file.
    pub file: u32,
    /// Its first block taken.
    pub first: usize,
    /// Blocks taken.
    pub count: usize,
    /// The prompt's block the first goes to.
    pub at: usize,
}

/// A restore found by [`SpillDir::find`]: the prompt's first `tokens` tokens, their blocks
/// from `pieces` in the prompt's order, and for hybrid models the state at their end from
/// file `state`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestorePlan {
    /// Tokens restored.
    pub tokens: usize,
    /// Where their blocks come from.
    pub pieces: Vec<RestorePiece>,
    /// The file holding the state at their end (hybrid models).
    pub state: Option<u32>,
}

impl RestorePlan {
    /// The files it reads, each once, in order.
    pub fn files(&self) -> Vec<u32> {
        let mut files: Vec<u32> = Vec::new();
        for f in self.pieces.iter().map(|p| p.file).chain(self.state) {
            if !files.contains(&f) {
                files.push(f);
            }
        }
        files
    }
}

/// A background write of a session file, giving back the run's KV buffers.
type Writer = std::thread::JoinHandle<Result<Vec<Vec<u8>>, EngineError>>;

/// The folder of session files and the index of the blocks and checkpoints in them.
#[derive(Debug)]
pub struct SpillDir {
    dir: PathBuf,
    fingerprint: u64,
    block_size: usize,
    max_bytes: u64,
    blocks: HashMap<u64, BlockAt>,
    states: HashMap<u64, FileId>,
    files: HashMap<FileId, RunMeta>,
    bytes: u64,
    next: FileId,
    clock: u64,
    /// Files being written by a background thread (the engine does not wait for the disk);
    /// each gives its KV buffers back when done.
    writing: Vec<(FileId, Writer)>,
    /// KV buffers of finished writes, for the next spill to read into: memory the process
    /// has touched already (a fresh buffer of hundreds of MB costs its page faults).
    spare: Vec<Vec<u8>>,
    /// Files being restored from, which the byte cap must not delete, with how many
    /// restores read each.
    pinned: HashMap<FileId, usize>,
    /// Files whose background write has finished (flushed and renamed into place).
    written: Arc<AtomicU64>,
}

fn bad(path: &Path, detail: impl Into<String>) -> EngineError {
    EngineError::Spill {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

impl SpillDir {
    /// Opens (creating) `dir` and indexes the session files in it that match `fingerprint`
    /// and `block_size`; unreadable or mismatched files (an older format's among them) are
    /// deleted. `written` counts each file whose background write finishes.
    pub fn open(
        dir: &Path,
        fingerprint: u64,
        block_size: usize,
        max_bytes: u64,
        written: Arc<AtomicU64>,
    ) -> Result<Self, EngineError> {
        std::fs::create_dir_all(dir).map_err(|e| bad(dir, e.to_string()))?;
        let mut found = Vec::new();
        let entries = std::fs::read_dir(dir).map_err(|e| bad(dir, e.to_string()))?;
        for entry in entries.flatten() {
            let path = entry.path();
            let ext = path.extension().and_then(|e| e.to_str());
            let id = path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| FileId::from_str_radix(s, 16).ok());
            match (ext, id) {
                // A write that a crash cut short.
                (Some("tmp"), _) => {
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
                (Some("run"), Some(id)) => {
                    let meta = entry.metadata().ok();
                    match SpillFile::read_tokens(&path, fingerprint) {
                        Ok(run) => {
                            let modified = meta.as_ref().and_then(|m| m.modified().ok());
                            let bytes = meta.map_or(0, |m| m.len());
                            found.push((modified, id, run, bytes));
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "deleting an unusable session file");
                            let _ = std::fs::remove_file(&path);
                        }
                    }
                }
                // Version 3's one file a prefix.
                (Some("spill"), _) => {
                    tracing::warn!(path = %path.display(), "deleting a session file of an older format");
                    let _ = std::fs::remove_file(&path);
                }
                _ => {}
            }
        }
        found.sort_by_key(|f| (f.0, f.1));
        let mut spill = Self {
            dir: dir.to_path_buf(),
            fingerprint,
            block_size: block_size.max(1),
            max_bytes,
            blocks: HashMap::new(),
            states: HashMap::new(),
            files: HashMap::new(),
            bytes: 0,
            next: 0,
            clock: 0,
            writing: Vec::new(),
            spare: Vec::new(),
            pinned: HashMap::new(),
            written,
        };
        for (_, id, (parent, tokens, state), bytes) in found {
            spill.next = spill.next.max(id.saturating_add(1));
            // Only a run with a state may be empty or end inside a block.
            if state == 0 && (tokens.is_empty() || !tokens.len().is_multiple_of(spill.block_size)) {
                let _ = std::fs::remove_file(spill.path(id));
                continue;
            }
            spill.index(id, parent, &tokens, state > 0, bytes);
        }
        spill.trim(0);
        Ok(spill)
    }

    /// The fingerprint files must carry.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Files in the folder.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Bytes on disk.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Blocks the index knows.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The most bytes the index can take for a folder of `max_bytes` whose blocks are
    /// `block_bytes` each on disk (as many files as blocks at worst): what the memory plan
    /// counts.
    pub fn max_index_bytes(max_bytes: u64, block_bytes: u64) -> u64 {
        max_bytes / block_bytes.max(1) * (INDEX_BYTES_PER_BLOCK + INDEX_BYTES_PER_FILE) as u64
    }

    /// The path of file `id`.
    pub fn path(&self, id: FileId) -> PathBuf {
        self.dir.join(format!("{id:08x}.run"))
    }

    /// Indexes file `id`: a run after `parent` of `tokens`, with a state at its end or not.
    fn index(&mut self, id: FileId, parent: u64, tokens: &[u32], state: bool, bytes: u64) {
        let bs = self.block_size;
        let mut keys = Vec::with_capacity(tokens.len() / bs);
        let mut last = ChainHash(parent);
        for (i, h) in ChainHash(parent).along(tokens).enumerate() {
            if (i + 1).is_multiple_of(bs) {
                keys.push(h.0);
            }
            last = h;
        }
        for (index, &key) in keys.iter().enumerate() {
            // The first file to hold a block keeps it (a later one holds it only when an
            // earlier block of its chain was missing).
            self.blocks.entry(key).or_insert(BlockAt {
                file: id,
                index: index as u32,
            });
        }
        let state = state.then_some(last.0);
        if let Some(key) = state {
            self.states.insert(key, id);
        }
        self.clock += 1;
        self.files.insert(
            id,
            RunMeta {
                blocks: keys,
                state,
                bytes,
                last_used: self.clock,
            },
        );
        self.bytes += bytes;
    }

    /// What of `tokens` (a cached prefix) to write: the blocks after those the folder holds,
    /// and with `state` (hybrid models: the recurrent state at the prefix's end, without
    /// which its blocks are of no use) the state and the partly filled block it falls in;
    /// `None` when the folder holds all of it already. Files whose blocks it reuses are
    /// marked used.
    pub fn plan_write(&mut self, tokens: &[u32], state: bool) -> Option<WritePlan> {
        let bs = self.block_size;
        let whole = tokens.len() / bs;
        let hashes: Vec<ChainHash> = ChainHash::START.along(tokens).collect();
        let key = |blocks: usize| {
            if blocks == 0 {
                ChainHash::START.0
            } else {
                hashes[blocks * bs - 1].0
            }
        };
        let mut first_block = 0;
        while first_block < whole && self.blocks.contains_key(&key(first_block + 1)) {
            first_block += 1;
        }
        let used: Vec<FileId> = (0..first_block)
            .filter_map(|b| self.blocks.get(&key(b + 1)).map(|at| at.file))
            .collect();
        for file in used {
            self.touch(file);
        }
        let plan = if state {
            let end = tokens.len();
            let done = end == 0 || self.states.contains_key(&hashes[end - 1].0);
            (!done).then_some(WritePlan {
                first_block,
                end,
                parent: key(first_block),
                state: true,
            })
        } else {
            (first_block < whole).then_some(WritePlan {
                first_block,
                end: whole * bs,
                parent: key(first_block),
                state: false,
            })
        };
        if let Some(file) = plan.is_none().then(|| self.state_file(&hashes)).flatten() {
            self.touch(file);
        }
        plan
    }

    /// The file of the state at the end of the tokens whose hashes are `hashes`, if any.
    fn state_file(&self, hashes: &[ChainHash]) -> Option<FileId> {
        hashes.last().and_then(|h| self.states.get(&h.0).copied())
    }

    /// Whether a file of `bytes` more fits under the byte cap without dropping another.
    pub fn has_room(&self, bytes: u64) -> bool {
        self.bytes + bytes <= self.max_bytes
    }

    /// The restore of the longest start of `tokens` the folder holds, of at most
    /// `max_tokens` tokens: whole blocks, or for hybrid models (`state`) the tokens up to the
    /// deepest checkpoint whose blocks are all there. `None` when it holds nothing usable.
    pub fn find(&self, tokens: &[u32], max_tokens: usize, state: bool) -> Option<RestorePlan> {
        if self.files.is_empty() {
            return None;
        }
        let bs = self.block_size;
        let limit = max_tokens.min(tokens.len());
        let hashes: Vec<ChainHash> = ChainHash::START.along(&tokens[..limit]).collect();
        let mut found: Vec<BlockAt> = Vec::new();
        while (found.len() + 1) * bs <= limit {
            match self.blocks.get(&hashes[(found.len() + 1) * bs - 1].0) {
                Some(&at) => found.push(at),
                None => break,
            }
        }
        let (len, state_file) = if state {
            // The deepest checkpoint within the found blocks and the one partly filled block
            // after them (its file holds that block).
            let reach = ((found.len() + 1) * bs - 1).min(limit);
            let (len, file) = (1..=reach)
                .rev()
                .find_map(|n| self.states.get(&hashes[n - 1].0).map(|&f| (n, f)))?;
            (len, Some(file))
        } else {
            (found.len() * bs, None)
        };
        if len == 0 {
            return None;
        }
        let whole = len / bs;
        let mut pieces: Vec<RestorePiece> = Vec::new();
        for (at, b) in found.iter().take(whole).enumerate() {
            match pieces.last_mut() {
                Some(p) if p.file == b.file && p.first + p.count == b.index as usize => {
                    p.count += 1
                }
                _ => pieces.push(RestorePiece {
                    file: b.file,
                    first: b.index as usize,
                    count: 1,
                    at,
                }),
            }
        }
        if let Some(file) = state_file
            && !len.is_multiple_of(bs)
        {
            // The state's run ends with the partly filled block the state falls in, after
            // its whole blocks.
            pieces.push(RestorePiece {
                file,
                first: self.files.get(&file).map_or(0, |m| m.blocks.len()),
                count: 1,
                at: whole,
            });
        }
        Some(RestorePlan {
            tokens: len,
            pieces,
            state: state_file,
        })
    }

    /// Keeps `file` (being restored from) from the byte cap until it is unpinned as often.
    pub fn pin(&mut self, file: FileId) {
        *self.pinned.entry(file).or_default() += 1;
    }

    /// Lets the byte cap have `file` again (once per pin).
    pub fn unpin(&mut self, file: FileId) {
        if let Some(n) = self.pinned.get_mut(&file) {
            *n -= 1;
            if *n == 0 {
                self.pinned.remove(&file);
            }
        }
    }

    /// Marks `file` as just used: the byte cap deletes least recently used files first.
    pub fn touch(&mut self, file: FileId) {
        self.clock += 1;
        if let Some(meta) = self.files.get_mut(&file) {
            meta.last_used = self.clock;
        }
    }

    /// Writes `run` (as planned by [`SpillDir::plan_write`]) to a new file in the
    /// background and indexes it, deleting the least recently used files past the byte cap;
    /// the file's size.
    pub fn add(&mut self, run: SpilledRun) -> Result<u64, EngineError> {
        self.reap();
        let id = self.next;
        self.next = self.next.saturating_add(1);
        let path = self.path(id);
        if run.state.is_empty()
            && (run.tokens.is_empty() || !run.tokens.len().is_multiple_of(self.block_size))
        {
            return Err(bad(&path, "a run without a state must hold whole blocks"));
        }
        let (_, size) = run.head(&path)?;
        self.trim(size);
        self.index(id, run.parent, &run.tokens, !run.state.is_empty(), size);
        let written = Arc::clone(&self.written);
        let target = path.clone();
        let writer = std::thread::Builder::new()
            .name("corral-spill".to_string())
            .spawn(move || {
                run.write(&target)?;
                written.fetch_add(1, Ordering::Relaxed);
                Ok(run.kv)
            })
            .map_err(|e| bad(&path, e.to_string()))?;
        self.writing.push((id, writer));
        Ok(size)
    }

    /// Joins the writers that are done, keeping their buffers (at most SPARE_BYTES) and
    /// forgetting the files whose write failed.
    fn reap(&mut self) {
        let (done, running): (Vec<_>, Vec<_>) =
            self.writing.drain(..).partition(|w| w.1.is_finished());
        self.writing = running;
        for (id, writer) in done {
            match writer.join() {
                Ok(Ok(buffers)) => self.keep_spare(buffers),
                _ => self.forget(id),
            }
        }
    }

    fn keep_spare(&mut self, buffers: Vec<Vec<u8>>) {
        self.spare = buffers;
        let mut kept = 0;
        self.spare.retain(|b| {
            kept += b.capacity();
            kept <= SPARE_BYTES
        });
    }

    /// Buffers for the next spill to read its KV into (see `spare`); empty when none are.
    pub fn take_buffers(&mut self) -> Vec<Vec<u8>> {
        self.reap();
        std::mem::take(&mut self.spare)
    }

    /// Waits for the background write of `file`, if one is running; false if it failed (the
    /// file is then forgotten).
    pub fn finish_write(&mut self, file: FileId) -> bool {
        let Some(i) = self.writing.iter().position(|w| w.0 == file) else {
            return self.files.contains_key(&file);
        };
        let (_, writer) = self.writing.swap_remove(i);
        match writer.join() {
            Ok(Ok(buffers)) => {
                self.keep_spare(buffers);
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "a session file could not be written");
                self.remove(file);
                false
            }
            Err(_) => {
                self.remove(file);
                false
            }
        }
    }

    /// Takes file `id` out of the index.
    fn forget(&mut self, id: FileId) {
        let Some(meta) = self.files.remove(&id) else {
            return;
        };
        for key in meta.blocks {
            if self.blocks.get(&key).is_some_and(|at| at.file == id) {
                self.blocks.remove(&key);
            }
        }
        if let Some(key) = meta.state
            && self.states.get(&key) == Some(&id)
        {
            self.states.remove(&key);
        }
        self.bytes -= meta.bytes;
    }

    /// Forgets and deletes file `id` (corrupt, or dropped for the byte cap).
    pub fn remove(&mut self, id: FileId) {
        self.forget(id);
        if let Some(i) = self.writing.iter().position(|w| w.0 == id) {
            let (_, writer) = self.writing.swap_remove(i);
            let _ = writer.join();
        }
        let _ = std::fs::remove_file(self.path(id));
    }

    /// Deletes the least recently used files until `incoming` more bytes fit the cap.
    fn trim(&mut self, incoming: u64) {
        while self.bytes + incoming > self.max_bytes {
            let Some(oldest) = self
                .files
                .iter()
                .filter(|(id, _)| !self.pinned.contains_key(id))
                .min_by_key(|(_, m)| m.last_used)
                .map(|(&id, _)| id)
            else {
                break;
            };
            self.remove(oldest);
        }
    }
}

impl Drop for SpillDir {
    /// Files still being written are finished, so that they survive the engine.
    fn drop(&mut self) {
        for (_, writer) in self.writing.drain(..) {
            let _ = writer.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BS: usize = 4;
    const LAYERS: usize = 2;
    /// Bytes of one block's K (or V) in one layer.
    const BLOCK: usize = 8;

    /// A block's K or V bytes in `layer`: made from its tokens and place, so that a block read
    /// back from the wrong file or place shows.
    fn block_bytes(tokens: &[u32], layer: usize, v: bool) -> Vec<u8> {
        let seed = tokens
            .iter()
            .fold(layer as u64 * 31 + v as u64, |h, &t| h * 131 + t as u64);
        (0..BLOCK)
            .map(|i| (seed >> (i % 8 * 7)) as u8 ^ i as u8)
            .collect()
    }

    /// What the engine would write of `tokens` per `plan` (KV from [`block_bytes`], a state
    /// made from the tokens).
    fn run_of(tokens: &[u32], plan: &WritePlan) -> SpilledRun {
        let run = tokens[plan.first_block * BS..plan.end].to_vec();
        let blocks: Vec<&[u32]> = run.chunks(BS).collect();
        let kv = (0..LAYERS)
            .map(|l| {
                let k = blocks.iter().flat_map(|b| block_bytes(b, l, false));
                let v = blocks.iter().flat_map(|b| block_bytes(b, l, true));
                k.chain(v).collect()
            })
            .collect();
        let state = if plan.state {
            tokens.iter().map(|&t| t as u8).chain([1]).collect()
        } else {
            Vec::new()
        };
        SpilledRun {
            fingerprint: 7,
            parent: plan.parent,
            block_size: BS,
            tokens: run,
            kv,
            state,
        }
    }

    fn write(dir: &mut SpillDir, tokens: &[u32], state: bool) -> Option<WritePlan> {
        let plan = dir.plan_write(tokens, state)?;
        dir.add(run_of(tokens, &plan)).unwrap();
        Some(plan)
    }

    /// The bytes a restore gives, block by block (as the engine copies them), and its state;
    /// every file's write finished first.
    fn restore(dir: &mut SpillDir, prompt: &[u32], plan: &RestorePlan) -> (Vec<Vec<u8>>, Vec<u8>) {
        let files: HashMap<u32, SpillFile> = plan
            .files()
            .into_iter()
            .map(|f| {
                assert!(dir.finish_write(f));
                (f, SpillFile::read(&dir.path(f), 7).unwrap())
            })
            .collect();
        let mut blocks = vec![Vec::new(); plan.tokens.div_ceil(BS)];
        for p in &plan.pieces {
            let f = &files[&p.file];
            let from = p.first * BS;
            let to = ((p.first + p.count) * BS).min(f.tokens().len());
            assert_eq!(
                &f.tokens()[from..to],
                &prompt[p.at * BS..p.at * BS + to - from]
            );
            for i in 0..p.count {
                for l in 0..LAYERS {
                    let (k, v) = f.blocks(l, p.first + i, 1);
                    blocks[p.at + i].extend_from_slice(k);
                    blocks[p.at + i].extend_from_slice(v);
                }
            }
        }
        let state = plan
            .state
            .map_or(Vec::new(), |f| files[&f].state().to_vec());
        (blocks, state)
    }

    /// What a restore of `prompt`'s first `tokens` tokens must give.
    fn expected(prompt: &[u32], tokens: usize, state: bool) -> (Vec<Vec<u8>>, Vec<u8>) {
        let blocks = prompt[..tokens]
            .chunks(BS)
            .map(|b| {
                (0..LAYERS)
                    .flat_map(|l| [block_bytes(b, l, false), block_bytes(b, l, true)].concat())
                    .collect()
            })
            .collect();
        let state = if state {
            prompt[..tokens]
                .iter()
                .map(|&t| t as u8)
                .chain([1])
                .collect()
        } else {
            Vec::new()
        };
        (blocks, state)
    }

    fn open(d: &tempfile::TempDir, max_bytes: u64) -> SpillDir {
        SpillDir::open(d.path(), 7, BS, max_bytes, Arc::default()).unwrap()
    }

    fn folder(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("corral-sessions-{name}-"))
            .tempdir()
            .unwrap()
    }

    #[test]
    fn chain_hashes_are_equal_for_equal_prefixes_only() {
        let a: Vec<ChainHash> = ChainHash::START.along(&[1, 2, 3]).collect();
        let b: Vec<ChainHash> = ChainHash::START.along(&[1, 2, 4]).collect();
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(ChainHash::START.then(0), ChainHash::START);
        let swapped: Vec<ChainHash> = ChainHash::START.along(&[2, 1]).collect();
        assert_ne!(swapped[1], a[1]);
    }

    /// Sessions sharing a system prompt share its blocks on disk: a second session writes
    /// only its own blocks, a grown history only the turn's, and a restore gathers them from
    /// every file; the index comes back after a restart, and the byte cap drops the least
    /// recently used file, never a pinned one.
    #[test]
    fn shared_prefixes_are_written_once_and_restored_from_several_files() {
        let d = folder("shared");
        let mut dir = open(&d, 1 << 20);
        let system: Vec<u32> = (0..12).collect();
        let a: Vec<u32> = system.iter().copied().chain(100..110).collect();
        let b: Vec<u32> = system.iter().copied().chain(200..210).collect();
        let plan = write(&mut dir, &a, false).unwrap();
        assert_eq!((plan.first_block, plan.end), (0, 20), "whole blocks only");
        let plan = write(&mut dir, &b, false).unwrap();
        assert_eq!(
            (plan.first_block, plan.end),
            (3, 20),
            "the system prompt is on disk"
        );
        assert_eq!(dir.plan_write(&b, false), None, "all of it is on disk");
        assert_eq!(dir.plan_write(&b[..13], false), None, "its blocks are");
        let grown: Vec<u32> = b.iter().copied().chain(300..308).collect();
        let plan = write(&mut dir, &grown, false).unwrap();
        assert_eq!(
            (plan.first_block, plan.end),
            (5, 28),
            "the new turn's blocks"
        );
        assert_eq!((dir.len(), dir.num_blocks()), (3, 9));
        let prompt: Vec<u32> = grown.iter().copied().chain([9, 9]).collect();
        let found = dir.find(&prompt, prompt.len(), false).unwrap();
        assert_eq!(found.tokens, 28);
        assert_eq!(found.files().len(), 3, "{found:?}");
        assert_eq!(
            restore(&mut dir, &prompt, &found),
            expected(&prompt, 28, false)
        );
        assert_eq!(dir.find(&prompt, 27, false).unwrap().tokens, 24, "capped");
        assert_eq!(dir.find(&[5, 6, 7, 8], 4, false), None);
        drop(dir);
        // A restart indexes the same blocks (and deletes what is not a session file).
        std::fs::write(d.path().join("0000beef.run"), b"not a session file").unwrap();
        std::fs::write(d.path().join("cut.tmp"), b"partial").unwrap();
        let mut dir = open(&d, 1 << 20);
        assert_eq!((dir.len(), dir.num_blocks()), (3, 9));
        assert!(!d.path().join("0000beef.run").exists() && !d.path().join("cut.tmp").exists());
        let again = dir.find(&prompt, prompt.len(), false).unwrap();
        assert_eq!(
            restore(&mut dir, &prompt, &again),
            expected(&prompt, 28, false)
        );
        // Another model's folder holds nothing for this one.
        assert!(
            SpillDir::open(d.path(), 8, BS, 1 << 20, Arc::default())
                .unwrap()
                .is_empty()
        );
        // A cap of two files: the least recently used goes (the first session's own blocks,
        // its system prompt being in use), never a pinned file.
        let mut dir = {
            for n in 0..4u32 {
                let _ = std::fs::remove_file(d.path().join(format!("{n:08x}.run")));
            }
            open(&d, 1 << 20)
        };
        assert!(dir.is_empty());
        write(&mut dir, &a, false);
        let size = dir.bytes();
        write(&mut dir, &b, false);
        let mut capped = {
            drop(dir);
            SpillDir::open(d.path(), 7, BS, 2 * size, Arc::default()).unwrap()
        };
        assert_eq!(capped.len(), 2, "both fit");
        let found = capped.find(&b, b.len(), false).unwrap();
        for f in found.files() {
            capped.touch(f);
            capped.pin(f);
        }
        write(&mut capped, &grown, false);
        assert_eq!(
            capped.find(&b, b.len(), false).unwrap().tokens,
            20,
            "pinned files stay"
        );
        for f in found.files() {
            capped.unpin(f);
        }
        write(&mut capped, &(500..540).collect::<Vec<u32>>(), false);
        assert!(capped.bytes() <= 2 * size);
        assert_eq!(capped.find(&b, b.len(), false), None, "dropped for the cap");
    }

    /// Hybrid models: a prefix is written with the state at its end and the partly filled
    /// block it falls in; a restore stops at the deepest checkpoint whose blocks are all on
    /// disk, and takes its last block from the checkpoint's file.
    #[test]
    fn a_checkpoint_restores_with_its_partly_filled_block() {
        let d = folder("hybrid");
        let mut dir = open(&d, 1 << 20);
        let turn: Vec<u32> = (0..14).collect();
        assert_eq!(write(&mut dir, &turn, true).unwrap().end, 14);
        assert_eq!(dir.plan_write(&turn, true), None, "its state is on disk");
        let longer: Vec<u32> = (0..22).collect();
        let plan = write(&mut dir, &longer, true).unwrap();
        assert_eq!((plan.first_block, plan.end), (3, 22));
        // At a block's end: a run of no new block, only the state.
        let plan = write(&mut dir, &longer[..16], true).unwrap();
        assert_eq!((plan.first_block, plan.end), (4, 16));
        for (prompt_len, max, restored) in [(30, 30, 22), (30, 21, 16), (15, 15, 14), (13, 13, 0)] {
            let prompt: Vec<u32> = (0..prompt_len).collect();
            match dir.find(&prompt, max, true) {
                Some(found) => {
                    assert_eq!(found.tokens, restored, "{prompt_len} {max}");
                    assert_eq!(
                        restore(&mut dir, &prompt, &found),
                        expected(&prompt, restored, true)
                    );
                }
                None => assert_eq!(restored, 0),
            }
        }
        // A branch inside the checkpoint's block: the tail there is not the prompt's.
        let branch: Vec<u32> = (0..13).chain([99, 98]).collect();
        assert_eq!(dir.find(&branch, branch.len(), true), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Whatever prefixes were written, in whatever order, a restore gives the longest
        /// start of a prompt that some written prefix covers in whole blocks (or, with
        /// states, ends at), with every byte as written.
        #[test]
        fn a_restore_gives_the_longest_written_start(
            writes in proptest::collection::vec((0u32..3, 1usize..30, any::<bool>()), 1..8),
            prompt in (0u32..3, 1usize..40),
            state in any::<bool>(),
        ) {
            // Token i of branch b: shared by every branch for its first 10 tokens.
            let seq = |b: u32, n: usize| -> Vec<u32> {
                (0..n as u32).map(|i| if i < 10 { i } else { 1000 * (b + 1) + i }).collect()
            };
            let d = folder("prop");
            let mut dir = open(&d, 1 << 30);
            let mut written: Vec<Vec<u32>> = Vec::new();
            for &(b, n, _) in &writes {
                let tokens = seq(b, n);
                if state || n >= BS {
                    write(&mut dir, &tokens, state);
                    written.push(tokens);
                }
            }
            let prompt = seq(prompt.0, prompt.1);
            let best = written
                .iter()
                .map(|w| {
                    let common = w.iter().zip(&prompt).take_while(|(a, b)| a == b).count();
                    if state {
                        if common == w.len() { common } else { 0 }
                    } else {
                        common / BS * BS
                    }
                })
                .max()
                .unwrap_or(0);
            match dir.find(&prompt, prompt.len(), state) {
                Some(found) => {
                    prop_assert_eq!(found.tokens, best);
                    prop_assert_eq!(
                        restore(&mut dir, &prompt, &found),
                        expected(&prompt, best, state)
                    );
                }
                None => prop_assert_eq!(best, 0),
            }
        }
    }
}
