//! A batch of tokens for `llama_decode`: positions, several sequence ids per token (the shape
//! tree verification needs), and which rows produce logits.

use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::{Error, Pos, Result, SeqId, Token};

/// Owns a `llama_batch` made by `llama_batch_init`.
pub struct Batch {
    raw: sys::llama_batch,
    capacity: usize,
    max_seq_ids: usize,
}

// SAFETY: the batch owns its heap arrays and holds no thread-affine state.
unsafe impl Send for Batch {}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: `raw` came from llama_batch_init and is freed exactly once.
        unsafe { sys::llama_batch_free(self.raw) }
    }
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("len", &self.len())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl Batch {
    /// A batch of up to `capacity` tokens, each in up to `max_seq_ids` sequences.
    pub fn new(capacity: usize, max_seq_ids: usize) -> Self {
        let capacity = capacity.max(1);
        let max_seq_ids = max_seq_ids.max(1);
        // SAFETY: allocates arrays of `capacity` entries (and `max_seq_ids` ids per entry).
        let raw = unsafe { sys::llama_batch_init(capacity as i32, 0, max_seq_ids as i32) };
        // llama_batch_init allocates with malloc; a null token array means it failed.
        assert!(
            NonNull::new(raw.token).is_some(),
            "llama_batch_init: out of memory"
        );
        Self {
            raw,
            capacity,
            max_seq_ids,
        }
    }

    /// Tokens in the batch.
    pub fn len(&self) -> usize {
        self.raw.n_tokens as usize
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.raw.n_tokens == 0
    }

    /// Capacity in tokens.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Remove every token (keeps the allocation).
    pub fn clear(&mut self) {
        self.raw.n_tokens = 0;
    }

    /// Append `token` at `pos`, belonging to every sequence in `seq_ids`; `logits` asks for its
    /// output row. Returns the row index (what [`crate::Context::logits`] takes).
    ///
    /// # Errors
    /// [`Error::BatchFull`], [`Error::TooManySeqIds`].
    pub fn add(&mut self, token: Token, pos: Pos, seq_ids: &[SeqId], logits: bool) -> Result<i32> {
        let i = self.len();
        if i >= self.capacity {
            return Err(Error::BatchFull {
                capacity: self.capacity,
            });
        }
        if seq_ids.is_empty() || seq_ids.len() > self.max_seq_ids {
            return Err(Error::TooManySeqIds {
                given: seq_ids.len(),
                max: self.max_seq_ids,
            });
        }
        // SAFETY: `i < capacity`, so every array index is within what llama_batch_init
        // allocated; `seq_id[i]` has room for `max_seq_ids >= seq_ids.len()` ids.
        unsafe {
            *self.raw.token.add(i) = token;
            *self.raw.pos.add(i) = pos;
            *self.raw.n_seq_id.add(i) = seq_ids.len() as i32;
            let ids = *self.raw.seq_id.add(i);
            std::ptr::copy_nonoverlapping(seq_ids.as_ptr(), ids, seq_ids.len());
            *self.raw.logits.add(i) = logits as i8;
        }
        self.raw.n_tokens += 1;
        Ok(i as i32)
    }

    /// Append a run of tokens of one sequence at consecutive positions from `pos0`; only the
    /// last gets logits when `logits_last` is set.
    ///
    /// # Errors
    /// [`Error::BatchFull`].
    pub fn add_sequence(
        &mut self,
        tokens: &[Token],
        pos0: Pos,
        seq: SeqId,
        logits_last: bool,
    ) -> Result<()> {
        for (k, &t) in tokens.iter().enumerate() {
            let last = k + 1 == tokens.len();
            self.add(t, pos0 + k as Pos, &[seq], logits_last && last)?;
        }
        Ok(())
    }

    /// Whether token `i` has an output row.
    pub fn wants_logits(&self, i: usize) -> bool {
        // SAFETY: `i < n_tokens <= capacity`.
        i < self.len() && unsafe { *self.raw.logits.add(i) } != 0
    }

    /// Ask for (or drop) the output row of token `i`.
    pub fn set_logits(&mut self, i: usize, on: bool) {
        if i < self.len() {
            // SAFETY: `i < n_tokens <= capacity`.
            unsafe { *self.raw.logits.add(i) = on as i8 }
        }
    }

    /// The token at row `i`.
    pub fn token(&self, i: usize) -> Option<Token> {
        // SAFETY: `i < n_tokens <= capacity`.
        (i < self.len()).then(|| unsafe { *self.raw.token.add(i) })
    }

    /// How many rows ask for logits.
    pub fn n_outputs(&self) -> usize {
        // SAFETY: indices below n_tokens are initialised.
        (0..self.len())
            .filter(|&i| unsafe { *self.raw.logits.add(i) } != 0)
            .count()
    }

    pub(crate) fn raw(&self) -> sys::llama_batch {
        self.raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_and_seq_ids_are_enforced() {
        let mut b = Batch::new(2, 2);
        assert_eq!(b.add(7, 0, &[0, 1], false).unwrap(), 0);
        assert_eq!(b.add(8, 1, &[0], true).unwrap(), 1);
        assert!(matches!(
            b.add(9, 2, &[0], true),
            Err(Error::BatchFull { capacity: 2 })
        ));
        b.clear();
        assert!(matches!(
            b.add(9, 0, &[0, 1, 2], true),
            Err(Error::TooManySeqIds { given: 3, max: 2 })
        ));
        assert!(matches!(
            b.add(9, 0, &[], true),
            Err(Error::TooManySeqIds { given: 0, .. })
        ));
        assert!(b.is_empty());
    }

    #[test]
    fn add_sequence_marks_only_the_last_row() {
        let mut b = Batch::new(8, 1);
        b.add_sequence(&[1, 2, 3], 10, 0, true).unwrap();
        assert_eq!(b.len(), 3);
        assert_eq!(b.n_outputs(), 1);
        assert_eq!(b.token(2), Some(3));
        assert_eq!(b.token(3), None);
        b.set_logits(0, true);
        assert_eq!(b.n_outputs(), 2);
        let raw = b.raw();
        // SAFETY: three initialised rows.
        let pos: Vec<i32> = (0..3).map(|i| unsafe { *raw.pos.add(i) }).collect();
        assert_eq!(pos, [10, 11, 12]);
    }
}
