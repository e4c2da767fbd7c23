//! A session file: one *run* of a cached prefix — the blocks of it that the folder did not
//! hold yet (their token ids and the KV bytes of every attention layer), and for hybrid models
//! the recurrent state at the prefix's end with the partly filled block it falls in. A run
//! names the chain hash of the tokens before it (its parent), so that a reader can hash its
//! blocks into the folder's index without the earlier tokens.
//!
//! A file is written to a temporary name and renamed into place, so a reader sees a whole
//! file or none. It starts with a magic, Corral's format version and a fingerprint of what the
//! bytes mean (model, KV dtype, block size, layouts); it ends with a checksum of everything
//! before it. A file that is short, corrupt or from another model or layout is refused with
//! an error naming what is wrong, and the caller deletes it and recomputes.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::EngineError;

const MAGIC: &[u8; 8] = b"CRLSPILL";
/// 4: a run of a prefix after its parent's chain hash (3: a whole prefix a file).
const VERSION: u32 = 4;
/// Header: magic, version, fingerprint, parent, block size, tokens, layers, bytes per layer,
/// state bytes.
pub(super) const HEADER_BYTES: usize = 8 + 4 + 8 + 8 + 4 + 4 + 4 + 8 + 8;
/// More attention layers than any model has: a header claiming more is refused.
const MAX_LAYERS: usize = 4096;

/// One run of a prefix to write (see the module's doc).
#[derive(Debug, Clone, PartialEq)]
pub struct SpilledRun {
    /// What the bytes mean: model, KV dtype, block size, layouts (see [`fingerprint`]).
    pub fingerprint: u64,
    /// The chain hash of the prefix's tokens before the run ([`super::ChainHash`]).
    pub parent: u64,
    /// Tokens per KV block.
    pub block_size: usize,
    /// The run's token ids, starting at a block boundary (its last block may be partly
    /// filled where a state follows).
    pub tokens: Vec<u32>,
    /// Per attention layer, the K then V bytes of the run's blocks, as the cache stores them.
    pub kv: Vec<Vec<u8>>,
    /// The recurrent state after the last token (hybrid models), as the state cache stores it.
    pub state: Vec<u8>,
}

/// A fingerprint of everything that decides how spilled bytes are read: FNV-1a over `parts`.
pub fn fingerprint(parts: &[&str]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &b in part.as_bytes().iter().chain(&[0u8]) {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// FNV-1a over 8-byte words in four interleaved lanes (so that their multiplies overlap),
/// folded together with the tail bytes: the hash of one piece of a file.
struct LaneSum {
    lanes: [u64; 4],
    pending: Vec<u8>,
}

impl LaneSum {
    fn new() -> Self {
        Self {
            lanes: [0, 1, 2, 3].map(|i| FNV_OFFSET ^ i),
            pending: Vec::with_capacity(32),
        }
    }

    fn update(&mut self, mut bytes: &[u8]) {
        if !self.pending.is_empty() {
            let take = (32 - self.pending.len()).min(bytes.len());
            self.pending.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.pending.len() < 32 {
                return;
            }
            let chunk = std::mem::take(&mut self.pending);
            self.chunk(&chunk);
            self.pending = chunk;
            self.pending.clear();
        }
        let chunks = bytes.chunks_exact(32);
        let rest = chunks.remainder();
        for chunk in chunks {
            self.chunk(chunk);
        }
        self.pending.extend_from_slice(rest);
    }

    fn chunk(&mut self, chunk: &[u8]) {
        for (lane, word) in self.lanes.iter_mut().zip(chunk.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(word);
            *lane = (*lane ^ u64::from_le_bytes(b)).wrapping_mul(FNV_PRIME);
        }
    }

    fn finish(self) -> u64 {
        let h = self
            .lanes
            .iter()
            .fold(FNV_OFFSET, |h, &l| (h ^ l).wrapping_mul(FNV_PRIME));
        self.pending
            .iter()
            .fold(h, |h, &b| (h ^ b as u64).wrapping_mul(FNV_PRIME))
    }

    fn of(bytes: &[u8]) -> u64 {
        let mut sum = Self::new();
        sum.update(bytes);
        sum.finish()
    }
}

/// Bytes of each piece of a file hashed on its own ([`LaneSum`]): a reader checks the pieces
/// on all cores.
const CHECK_PIECE_BYTES: usize = 16 << 20;

/// A corruption check fed in pieces of any size (as a file is written): the [`LaneSum`] of
/// each `piece`-byte piece of the stream, those hashes folded in order by FNV-1a.
struct Checksum {
    piece: usize,
    filled: usize,
    current: LaneSum,
    total: u64,
}

impl Checksum {
    fn new(piece: usize) -> Self {
        Self {
            piece: piece.max(1),
            filled: 0,
            current: LaneSum::new(),
            total: FNV_OFFSET,
        }
    }

    fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let take = (self.piece - self.filled).min(bytes.len());
            self.current.update(&bytes[..take]);
            self.filled += take;
            bytes = &bytes[take..];
            if self.filled == self.piece {
                let done = std::mem::replace(&mut self.current, LaneSum::new());
                self.total = fold(self.total, done.finish());
                self.filled = 0;
            }
        }
    }

    fn finish(self) -> u64 {
        if self.filled == 0 {
            self.total
        } else {
            fold(self.total, self.current.finish())
        }
    }
}

fn fold(total: u64, piece: u64) -> u64 {
    (total ^ piece).wrapping_mul(FNV_PRIME)
}

/// [`Checksum`] of `bytes` in `piece`-byte pieces hashed on all cores; `None` once `cancel`
/// is set.
fn parallel_checksum(bytes: &[u8], piece: usize, cancel: &AtomicBool) -> Option<u64> {
    use rayon::prelude::*;
    let sums: Option<Vec<u64>> = bytes
        .par_chunks(piece.max(1))
        .map(|p| (!cancel.load(Ordering::Relaxed)).then(|| LaneSum::of(p)))
        .collect();
    Some(sums?.into_iter().fold(FNV_OFFSET, fold))
}

#[cfg(test)]
fn checksum(bytes: &[u8]) -> u64 {
    let mut sum = Checksum::new(CHECK_PIECE_BYTES);
    sum.update(bytes);
    sum.finish()
}

fn bad(path: &Path, detail: impl Into<String>) -> EngineError {
    EngineError::Spill {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

impl SpilledRun {
    /// Writes the run to `path` atomically (a temporary file in the same folder, flushed,
    /// then renamed), straight from its buffers; the file's size.
    pub fn write(&self, path: &Path) -> Result<u64, EngineError> {
        let (head, size) = self.head(path)?;
        let tmp = path.with_extension("tmp");
        let io = |e: std::io::Error| bad(path, e.to_string());
        let written = (|| {
            let mut file = std::fs::File::create(&tmp).map_err(io)?;
            let mut sum = Checksum::new(CHECK_PIECE_BYTES);
            let pieces = std::iter::once(&head[..])
                .chain(self.kv.iter().map(Vec::as_slice))
                .chain(std::iter::once(&self.state[..]));
            for piece in pieces {
                sum.update(piece);
                file.write_all(piece).map_err(io)?;
            }
            file.write_all(&sum.finish().to_le_bytes()).map_err(io)?;
            file.sync_all().map_err(io)?;
            drop(file);
            std::fs::rename(&tmp, path).map_err(io)
        })();
        if written.is_err() {
            // A failed write leaves no partial file behind (a full disk stays usable).
            let _ = std::fs::remove_file(&tmp);
        }
        written.map(|()| size)
    }

    /// The file's header and token list, and the size of the whole file; refuses layers of
    /// different sizes and counts beyond the header's fields.
    pub(super) fn head(&self, path: &Path) -> Result<(Vec<u8>, u64), EngineError> {
        let per_layer = self.kv.first().map_or(0, Vec::len);
        if self.kv.iter().any(|l| l.len() != per_layer) {
            return Err(bad(path, "layers of different sizes"));
        }
        let mut head = Vec::with_capacity(HEADER_BYTES + 4 * self.tokens.len());
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(&self.fingerprint.to_le_bytes());
        head.extend_from_slice(&self.parent.to_le_bytes());
        for n in [self.block_size, self.tokens.len(), self.kv.len()] {
            let n =
                u32::try_from(n).map_err(|_| bad(path, format!("{n} does not fit the header")))?;
            head.extend_from_slice(&n.to_le_bytes());
        }
        head.extend_from_slice(&(per_layer as u64).to_le_bytes());
        head.extend_from_slice(&(self.state.len() as u64).to_le_bytes());
        for t in &self.tokens {
            head.extend_from_slice(&t.to_le_bytes());
        }
        let size = head.len() + per_layer * self.kv.len() + self.state.len() + 8;
        Ok((head, size as u64))
    }
}

/// A session file mapped and checked: its tokens, and its KV and state bytes where they lie
/// in the file (no copy into the process; the checksum's pass brings them in from the page
/// cache).
#[derive(Debug)]
pub struct SpillFile {
    map: std::sync::Arc<corral_backend::MappedFile>,
    parent: u64,
    tokens: Vec<u32>,
    block_size: usize,
    layers: usize,
    per_layer: usize,
    state: usize,
}

impl SpillFile {
    /// Reads and checks the file at `path` against `expected_fingerprint`.
    pub fn read(path: &Path, expected_fingerprint: u64) -> Result<Self, EngineError> {
        Self::read_unless(path, expected_fingerprint, &AtomicBool::new(false))
    }

    /// [`SpillFile::read`], given up (an error) once `cancel` is set: the file is checked a
    /// piece at a time, so that a read nobody waits for any more stops reading the disk.
    pub fn read_unless(
        path: &Path,
        expected_fingerprint: u64,
        cancel: &AtomicBool,
    ) -> Result<Self, EngineError> {
        // Files are written under a temporary name and renamed, never changed in place.
        let map = corral_backend::MappedFile::open(path).map_err(|e| bad(path, e.to_string()))?;
        let bytes = map.bytes();
        let (tokens, header) = Self::header(path, bytes, expected_fingerprint)?;
        if header.block_size == 0 {
            return Err(bad(path, "a block size of 0"));
        }
        let body_end = bytes.len() - 8;
        let stored = u64::from_le_bytes(bytes[body_end..].try_into().unwrap_or_default());
        let Some(sum) = parallel_checksum(&bytes[..body_end], CHECK_PIECE_BYTES, cancel) else {
            return Err(bad(path, "the read was cancelled"));
        };
        if sum != stored {
            return Err(bad(path, "checksum mismatch (a corrupt file)"));
        }
        Ok(Self {
            map,
            parent: header.parent,
            tokens,
            block_size: header.block_size,
            layers: header.layers,
            per_layer: header.per_layer,
            state: header.state,
        })
    }

    /// The chain hash of the tokens before the run.
    pub fn parent(&self) -> u64 {
        self.parent
    }

    /// The run's token ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Attention layers.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Layer `i`'s K then V bytes (empty past the last layer).
    pub fn layer(&self, i: usize) -> &[u8] {
        if i >= self.layers {
            return &[];
        }
        let at = HEADER_BYTES + 4 * self.tokens.len() + i * self.per_layer;
        &self.map.bytes()[at..at + self.per_layer]
    }

    /// Blocks in the run (the last may be partly filled).
    pub fn num_blocks(&self) -> usize {
        self.tokens.len().div_ceil(self.block_size.max(1))
    }

    /// Layer `i`'s K and V bytes of the run's blocks `first..first + count` (empty past the
    /// last layer or block).
    pub fn blocks(&self, i: usize, first: usize, count: usize) -> (&[u8], &[u8]) {
        let n = self.num_blocks();
        if first + count > n {
            return (&[], &[]);
        }
        let layer = self.layer(i);
        let size = layer.len() / (2 * n).max(1);
        let (k, v) = layer.split_at(size * n);
        let range = size * first..size * (first + count);
        (&k[range.clone()], &v[range])
    }

    /// The recurrent state bytes (empty for non-hybrids).
    pub fn state(&self) -> &[u8] {
        let at = HEADER_BYTES + 4 * self.tokens.len() + self.layers * self.per_layer;
        &self.map.bytes()[at..at + self.state]
    }

    /// The parent hash, token ids and state size of the file at `path` (its header and token
    /// list only, checked for size and fingerprint, not the checksum): what the folder's
    /// index needs.
    pub fn read_tokens(
        path: &Path,
        expected_fingerprint: u64,
    ) -> Result<(u64, Vec<u32>, usize), EngineError> {
        use std::io::Read;
        let io = |e: std::io::Error| bad(path, e.to_string());
        let mut file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut head = vec![0u8; HEADER_BYTES];
        file.read_exact(&mut head)
            .map_err(|_| bad(path, format!("{len} bytes: shorter than a header")))?;
        let num_tokens = u32::from_le_bytes([head[32], head[33], head[34], head[35]]) as usize;
        if (HEADER_BYTES + 4 * num_tokens) as u64 > len {
            return Err(bad(
                path,
                format!("{len} bytes: shorter than its token list (a truncated file)"),
            ));
        }
        head.resize(HEADER_BYTES + 4 * num_tokens, 0);
        file.read_exact(&mut head[HEADER_BYTES..]).map_err(io)?;
        Self::header_of_len(path, &head, len, expected_fingerprint)
            .map(|(t, h)| (h.parent, t, h.state))
    }

    fn header(
        path: &Path,
        bytes: &[u8],
        expected_fingerprint: u64,
    ) -> Result<(Vec<u32>, Header), EngineError> {
        Self::header_of_len(path, bytes, bytes.len() as u64, expected_fingerprint)
    }

    /// The header and token list at the start of `bytes`, checked against a file of `len`
    /// bytes.
    fn header_of_len(
        path: &Path,
        bytes: &[u8],
        len: u64,
        expected_fingerprint: u64,
    ) -> Result<(Vec<u32>, Header), EngineError> {
        if len < (HEADER_BYTES + 8) as u64 || bytes.len() < HEADER_BYTES {
            return Err(bad(path, format!("{len} bytes: shorter than a header")));
        }
        if &bytes[..8] != MAGIC {
            return Err(bad(path, "not a Corral spill file (bad magic)"));
        }
        let u32_at =
            |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        let u64_at = |o: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[o..o + 8]);
            u64::from_le_bytes(b)
        };
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(
                path,
                format!("format version {version}, this build reads {VERSION}"),
            ));
        }
        if u64_at(12) != expected_fingerprint {
            return Err(bad(path, "written for another model, KV type or layout"));
        }
        let header = Header {
            parent: u64_at(20),
            block_size: u32_at(28) as usize,
            layers: u32_at(36) as usize,
            per_layer: usize::try_from(u64_at(40)).unwrap_or(usize::MAX),
            state: usize::try_from(u64_at(48)).unwrap_or(usize::MAX),
        };
        let num_tokens = u32_at(32) as usize;
        if header.layers > MAX_LAYERS {
            return Err(bad(path, format!("{} layers", header.layers)));
        }
        let expected = (|| {
            HEADER_BYTES
                .checked_add(num_tokens.checked_mul(4)?)?
                .checked_add(header.per_layer.checked_mul(header.layers)?)?
                .checked_add(header.state)?
                .checked_add(8)
        })();
        if expected.map(|e| e as u64) != Some(len) {
            return Err(bad(
                path,
                format!("{len} bytes where the header describes {expected:?} (a truncated file)"),
            ));
        }
        let tokens = bytes[HEADER_BYTES..HEADER_BYTES + 4 * num_tokens]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok((tokens, header))
    }
}

struct Header {
    parent: u64,
    block_size: usize,
    layers: usize,
    per_layer: usize,
    state: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix() -> SpilledRun {
        SpilledRun {
            fingerprint: fingerprint(&["model", "bf16", "16"]),
            parent: 0x1234_5678_9abc_def0,
            block_size: 4,
            tokens: (0..8).collect(),
            kv: vec![(0..64).collect(), (64..128).collect()],
            state: vec![7; 24],
        }
    }

    /// A fresh folder, removed when the test ends.
    fn dir(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("corral-spill-{name}-"))
            .tempdir()
            .unwrap()
    }

    #[test]
    fn a_cancelled_read_gives_up() {
        let d = dir("cancelled");
        std::fs::create_dir_all(&d).unwrap();
        let p = prefix();
        let path = d.path().join("a.spill");
        p.write(&path).unwrap();
        let cancel = AtomicBool::new(true);
        let err = SpillFile::read_unless(&path, p.fingerprint, &cancel).unwrap_err();
        assert!(err.to_string().contains("cancelled"), "{err}");
        cancel.store(false, Ordering::Relaxed);
        assert!(SpillFile::read_unless(&path, p.fingerprint, &cancel).is_ok());
    }

    #[test]
    fn a_failed_write_leaves_no_temporary_file() {
        let d = dir("failed-write");
        let path = d.path().join("a.spill");
        // The rename fails: a folder with something in it has the file's name.
        std::fs::create_dir_all(path.join("inside")).unwrap();
        assert!(prefix().write(&path).is_err());
        assert!(
            !path.with_extension("tmp").exists(),
            "the temporary file is removed"
        );
    }

    #[test]
    fn a_spilled_prefix_reads_back_and_bad_files_are_refused() {
        let d = dir("roundtrip");
        std::fs::create_dir_all(&d).unwrap();
        let p = prefix();
        let path = d.path().join("a.spill");
        let bytes = p.write(&path).unwrap();
        let back = SpillFile::read(&path, p.fingerprint).unwrap();
        assert_eq!(back.tokens(), &p.tokens[..]);
        assert_eq!(back.parent(), p.parent);
        assert_eq!(back.num_blocks(), 2);
        assert_eq!(back.blocks(1, 1, 1), (&p.kv[1][16..32], &p.kv[1][48..64]));
        assert_eq!(back.blocks(1, 1, 2), (&[][..], &[][..]));
        assert_eq!(
            SpillFile::read_tokens(&path, p.fingerprint).unwrap(),
            (p.parent, p.tokens.clone(), p.state.len())
        );
        assert_eq!(
            (back.block_size(), back.layers()),
            (p.block_size, p.kv.len())
        );
        for (i, layer) in p.kv.iter().enumerate() {
            assert_eq!(back.layer(i), &layer[..]);
        }
        assert_eq!(back.state(), &p.state[..]);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), bytes);
        assert!(
            !path.with_extension("tmp").exists(),
            "the temporary file is renamed"
        );
        let all = std::fs::read(&path).unwrap();
        let refused = |bytes: &[u8], fp: u64, what: &str| {
            std::fs::write(&path, bytes).unwrap();
            let err = SpillFile::read(&path, fp).unwrap_err().to_string();
            assert!(err.contains(what), "{what}: {err}");
        };
        refused(&all, p.fingerprint ^ 1, "another model");
        refused(&all[..all.len() - 3], p.fingerprint, "truncated");
        refused(&all[..10], p.fingerprint, "shorter than a header");
        let mut flipped = all.clone();
        flipped[HEADER_BYTES + 40] ^= 0x10;
        refused(&flipped, p.fingerprint, "checksum");
        let mut magic = all.clone();
        magic[0] = b'X';
        refused(&magic, p.fingerprint, "bad magic");
        let mut absurd = all.clone();
        absurd[32..36].copy_from_slice(&u32::MAX.to_le_bytes());
        refused(&absurd, p.fingerprint, "truncated");
    }

    /// The checksum fed in pieces of any size (as a file is written) equals it over the
    /// whole and the parallel one over its hashing pieces (as a file is read), and any
    /// flipped bit or swapped pair of words changes it.
    #[test]
    fn the_checksum_in_pieces_equals_the_whole_and_sees_changes() {
        let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let whole = checksum(&bytes);
        let go = AtomicBool::new(false);
        assert_eq!(
            parallel_checksum(&bytes, CHECK_PIECE_BYTES, &go),
            Some(whole)
        );
        for piece in [8, 64, 100, 999, 1000] {
            let mut sum = Checksum::new(piece);
            sum.update(&bytes);
            let expected = sum.finish();
            assert_eq!(
                parallel_checksum(&bytes, piece, &go),
                Some(expected),
                "{piece}"
            );
            if piece < 1000 {
                assert_ne!(expected, whole, "pieces of {piece} hash differently");
            }
        }
        for cuts in [
            vec![0, 1000],
            vec![3, 40, 41, 999],
            vec![31, 32, 33, 64, 95, 500],
        ] {
            for piece in [64, CHECK_PIECE_BYTES] {
                let mut sum = Checksum::new(piece);
                let mut at = 0;
                for cut in cuts.iter().copied().chain([1000]) {
                    sum.update(&bytes[at..cut]);
                    at = cut;
                }
                assert_eq!(
                    Some(sum.finish()),
                    parallel_checksum(&bytes, piece, &go),
                    "cuts {cuts:?}, pieces of {piece}"
                );
            }
        }
        assert_eq!(
            parallel_checksum(&bytes, 64, &AtomicBool::new(true)),
            None,
            "cancelled"
        );
        for i in [0, 7, 31, 32, 500, 999] {
            let mut flipped = bytes.clone();
            flipped[i] ^= 1;
            assert_ne!(checksum(&flipped), whole, "byte {i}");
        }
        let mut swapped = bytes.clone();
        swapped[..16].rotate_left(8);
        assert_ne!(checksum(&swapped), whole, "two words swapped");
    }
}
