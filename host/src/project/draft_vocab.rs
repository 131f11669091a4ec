//! [`DraftVocab`]: rows of the output weights copied out of the model file and kept
//! resident, and the best of them for a hidden state, so that a draft can pick its token
//! without touching the streamed projection.

use std::sync::{Arc, Mutex};

use super::Projection;
use crate::fileio::{open_direct, read_direct};
use crate::{Error, Result, Token};

/// Some rows of the output weights, copied out and kept resident: the vocabulary a draft
/// is allowed to choose from when the full output projection is streamed from storage.
/// Projecting a hidden state onto these rows only ([`DraftVocab::argmax`]) costs a few
/// thousand dot products and no I/O; the token is a draft, checked by the full projection.
pub struct DraftVocab {
    pub(super) proj: Arc<Projection>,
    /// Read around the page cache: `O_DIRECT`, else plain reads whose pages are dropped
    /// (flash: keep the budget honest).
    pub(super) drop_cache: bool,
    /// The rows' tokens, in the order they were added, each once.
    pub(super) tokens: Vec<Token>,
    /// The same tokens ascending (lookups).
    pub(super) sorted: Vec<Token>,
    /// The rows' bytes, in `tokens` order.
    pub(super) bytes: Vec<u8>,
}

impl std::fmt::Debug for DraftVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftVocab")
            .field("rows", &self.tokens.len())
            .finish()
    }
}

impl DraftVocab {
    /// Rows held.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it holds no row.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Resident bytes (the rows).
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Whether `token`'s row is held.
    pub fn contains(&self, token: Token) -> bool {
        self.sorted.binary_search(&token).is_ok()
    }

    /// Add the rows of `tokens` not held yet, in ascending order while fewer than `cap` are
    /// held (tokens outside the vocabulary are ignored).
    ///
    /// # Errors
    /// The model file cannot be read.
    pub fn add(&mut self, tokens: &[Token], cap: usize) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let p = &*self.proj;
        let mut new: Vec<Token> = tokens
            .iter()
            .copied()
            .filter(|&t| t >= 0 && (t as usize) < p.n_vocab && !self.contains(t))
            .collect();
        new.sort_unstable();
        new.dedup();
        new.truncate(cap.saturating_sub(self.len()));
        if new.is_empty() {
            return Ok(());
        }
        let io = |e: std::io::Error| Error::InvalidGguf {
            path: p.path.clone(),
            reason: format!("reading output weight rows: {e}"),
        };
        // Streamed weights: read around the page cache, which would keep (large) folios of
        // the streamed matrix resident behind the budget's back. Plain reads otherwise, or
        // where the file system refuses O_DIRECT.
        let direct = if self.drop_cache {
            open_direct(std::path::Path::new(&p.path)).ok()
        } else {
            None
        };
        let mut buffered: Option<std::fs::File> = None;
        let rb = p.row_bytes;
        let start = self.bytes.len();
        self.bytes.resize(start + new.len() * rb, 0);
        let drop_cache = self.drop_cache;
        let bytes = &mut self.bytes;
        // Runs of consecutive tokens in one read each.
        let mut read = || -> Result<()> {
            let mut i = 0;
            while i < new.len() {
                let mut j = i + 1;
                while j < new.len() && new[j] == new[j - 1] + 1 {
                    j += 1;
                }
                let at = p.offset + new[i] as u64 * rb as u64;
                let buf = &mut bytes[start + i * rb..start + j * rb];
                let read_direct = direct
                    .as_ref()
                    .is_some_and(|d| read_direct(d, buf, at).is_ok());
                if !read_direct {
                    let f = match &mut buffered {
                        Some(f) => f,
                        None => buffered.insert(std::fs::File::open(&p.path).map_err(io)?),
                    };
                    f.read_exact_at(buf, at).map_err(io)?;
                    if drop_cache {
                        use std::os::unix::io::AsRawFd;
                        // SAFETY: an advisory call on an open descriptor; no memory is touched.
                        unsafe {
                            libc::posix_fadvise(
                                f.as_raw_fd(),
                                at as libc::off_t,
                                buf.len() as libc::off_t,
                                libc::POSIX_FADV_DONTNEED,
                            )
                        };
                    }
                }
                i = j;
            }
            Ok(())
        };
        if let Err(e) = read() {
            // Rows and tokens stay in step: nothing of a failed add is kept.
            self.bytes.truncate(start);
            return Err(e);
        }
        self.tokens.extend_from_slice(&new);
        self.sorted.extend_from_slice(&new);
        self.sorted.sort_unstable();
        Ok(())
    }

    /// The held token with the largest logit after hidden state `h` (the smallest id among
    /// equal maxima), and its logit; `None` when nothing is held. Each logit is bit-identical
    /// to the full projection's for that token (Leap's kernel is checked against ggml's).
    pub fn argmax(&self, h: &[f32]) -> Option<(Token, f32)> {
        let p = &*self.proj;
        let act = p.quantize(h);
        let rb = p.row_bytes;
        let n = self.tokens.len();
        let prepared = p
            .kernel
            .map(|k| (k, k.prepare(p.n_embd, &[act.as_slice()])));
        let (prepared, act) = (&prepared, &act);
        // Rows are in arrival order: the larger logit wins, the smaller id a tie.
        let better = |(i, v): (usize, f32), best: Option<(usize, f32)>| {
            best.is_none_or(|(bi, b)| v > b || (v == b && self.tokens[i] < self.tokens[bi]))
        };
        let bests: Mutex<Vec<(usize, f32)>> = Mutex::new(Vec::new());
        // On the OpenMP team ggml's decode just used (its workers are still awake).
        crate::par::parallel(p.threads, &|t, threads| {
            let per = n.div_ceil(threads).max(1);
            let (lo, hi) = ((t * per).min(n), ((t + 1) * per).min(n));
            let mut best: Option<(usize, f32)> = None;
            let mut vals = [0.0f32; 256];
            for i0 in (lo..hi).step_by(256) {
                let m = 256.min(hi - i0);
                let vals = &mut vals[..m];
                let w = &self.bytes[i0 * rb..(i0 + m) * rb];
                match prepared {
                    Some((k, a)) => k.dot_many(a, w, vals),
                    None => {
                        for (j, v) in vals.iter_mut().enumerate() {
                            p.dot_row(&w[j * rb..(j + 1) * rb], act, v);
                        }
                    }
                }
                for (j, &v) in vals.iter().enumerate() {
                    if better((i0 + j, v), best) {
                        best = Some((i0 + j, v));
                    }
                }
            }
            if let Some(b) = best {
                bests.lock().unwrap_or_else(|e| e.into_inner()).push(b);
            }
        });
        let mut best = None;
        for b in bests.into_inner().unwrap_or_else(|e| e.into_inner()) {
            if better(b, best) {
                best = Some(b);
            }
        }
        best.map(|(i, v)| (self.tokens[i], v))
    }
}
