//! A head that looks one token further ahead: given the target's final hidden state after a
//! token and the token the target chose next, it guesses the token after that, so the target
//! drafting for itself ([`crate::vocab`]) can put a second row in a step's call and, where the
//! guess holds, get two tokens' hidden states for one call's fixed cost.
//!
//! It is an early-exit head's form ([`crate::head`]) with a second input, the conditioning
//! that EAGLE found decisive (the next token settles what the hidden state left open):
//!
//! ```text
//! score(c | h, t) = e_c · u,   u = A · [n(h); n(e_t)]
//! ```
//!
//! `h` is the final normalised hidden state (`result_norm`, what the output projection reads),
//! `e_t` the output-embedding row of the token chosen after it, `n` the head's
//! [`rms_normalize`], `e_c` the output-embedding row of a candidate and `A` (`d x 2d`) the only
//! thing training learns ([`crate::head::train`] on samples whose input is `[h; e_t]` and whose
//! teacher is the target's distribution one position later; `leap train-heads --ahead`).
//! Scored over the resident vocabulary, the guess costs a `d x 2d` product and what the
//! resident argmax costs.
//!
//! A guess is only a draft: it stands when the target's own choice after it is the same token,
//! so greedy output is plain decoding's whatever the head says. The head lives in the model's
//! sidecar beside the early-exit head, under its own keys ([`keys`]).

use leap_host::sidecar::{Sidecar, Value};

use crate::exit::ModelShape;
use crate::head::rms_normalize;

/// Sidecar keys of the head.
pub mod keys {
    pub const N_EMBD: &str = "leap.ahead.n_embd";
    pub const A: &str = "leap.ahead.a";
    /// The fingerprint of the output weights it was trained with.
    pub const MODEL: &str = "leap.ahead.model";
    pub const CORPUS: &str = "leap.ahead.corpus";
}

/// A head that guesses the token after next (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Ahead {
    /// Hidden-state width d.
    pub n_embd: usize,
    /// d x 2d, row-major: `u[i] = sum_j a[i * 2d + j] * [n(h); n(e_t)][j]`.
    pub a: Vec<f32>,
}

impl Ahead {
    /// The query `u` after final hidden state `h` and the next token's output-embedding row
    /// `e` into `out` (each length d): the guess is the candidate whose output-embedding row
    /// has the largest dot product with it. Panics if the lengths are not `n_embd`'s.
    pub fn query(&self, h: &[f32], e: &[f32], out: &mut [f32]) {
        let mut x = vec![0.0; 2 * self.n_embd];
        self.query_into(h, e, &mut x, out);
    }

    /// [`Ahead::query`] with the normalised input `[n(h); n(e)]` built in `x` (length 2d), so
    /// a caller that guesses every step allocates nothing.
    pub fn query_into(&self, h: &[f32], e: &[f32], x: &mut [f32], out: &mut [f32]) {
        let d = self.n_embd;
        assert!(h.len() == d && e.len() == d && out.len() == d, "lengths");
        assert_eq!(x.len(), 2 * d, "input buffer");
        assert_eq!(self.a.len(), 2 * d * d, "A is not d x 2d");
        let (xh, xe) = x.split_at_mut(d);
        rms_normalize(h, xh);
        rms_normalize(e, xe);
        for (o, row) in out.iter_mut().zip(self.a.chunks_exact(2 * d)) {
            *o = crate::head::dot(row, x);
        }
    }
}

/// Put `head` (trained on `corpus`, with the output weights of this [`fingerprint`]) into
/// `side`.
///
/// [`fingerprint`]: leap_host::project::fingerprint
pub fn store(side: &mut Sidecar, head: &Ahead, fingerprint: &str, corpus: &str) {
    side.set(keys::N_EMBD, Value::U32(head.n_embd as u32));
    side.set(keys::A, Value::F32s(head.a.clone()));
    side.set(keys::MODEL, Value::Str(fingerprint.to_string()));
    side.set(keys::CORPUS, Value::Str(corpus.to_string()));
}

/// The head in `side`, if it has one, checked against `model`. `Err` says why a head that is
/// there cannot be used.
pub fn load(side: &Sidecar, model: &ModelShape) -> Result<Option<Ahead>, String> {
    let Some(d) = side.u32(keys::N_EMBD) else {
        return Ok(None);
    };
    let d = d as usize;
    match side.get(keys::MODEL) {
        Some(Value::Str(s)) if *s == model.fingerprint => {}
        Some(Value::Str(s)) => {
            return Err(format!(
                "it was trained on another model (output weights {s}, this model's {})",
                model.fingerprint
            ))
        }
        _ => return Err(format!("it has no {}", keys::MODEL)),
    }
    if d != model.n_embd {
        return Err(format!(
            "it is for {d}-wide hidden states; this model's are {}-wide",
            model.n_embd
        ));
    }
    let a = side.f32s(keys::A).unwrap_or(&[]);
    if a.len() != 2 * d * d || a.iter().any(|x| !x.is_finite()) {
        return Err(format!(
            "{} has {} values (want {} finite ones)",
            keys::A,
            a.len(),
            2 * d * d
        ));
    }
    Ok(Some(Ahead {
        n_embd: d,
        a: a.to_vec(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(d: usize) -> ModelShape {
        ModelShape {
            fingerprint: "abc".into(),
            n_embd: d,
            n_layer: 4,
            n_vocab: 100,
        }
    }

    #[test]
    fn query_normalises_each_input_on_its_own() {
        // A = [I | 2I] over d = 2: u = n(h) + 2 n(e).
        let head = Ahead {
            n_embd: 2,
            a: vec![1.0, 0.0, 2.0, 0.0, 0.0, 1.0, 0.0, 2.0],
        };
        let mut u = [0.0; 2];
        // n([3, 4]) = [3, 4] / sqrt(12.5); n([0, -10]) = [0, -sqrt(2)].
        head.query(&[3.0, 4.0], &[0.0, -10.0], &mut u);
        let s = (12.5f64 + 1e-6).sqrt() as f32;
        let want = [3.0 / s, 4.0 / s - 2.0 * 2f32.sqrt()];
        for (g, w) in u.iter().zip(want) {
            assert!((g - w).abs() < 1e-4, "{u:?} vs {want:?}");
        }
    }

    #[test]
    fn a_stored_head_loads_back_and_a_wrong_one_is_refused() {
        let head = Ahead {
            n_embd: 3,
            a: (0..18).map(|i| i as f32 * 0.5).collect(),
        };
        let mut side = Sidecar::default();
        assert_eq!(load(&side, &shape(3)), Ok(None), "no head: none");
        store(&mut side, &head, "abc", "dev.jsonl");
        assert_eq!(load(&side, &shape(3)), Ok(Some(head.clone())));
        let other = ModelShape {
            fingerprint: "xyz".into(),
            ..shape(3)
        };
        assert!(load(&side, &other).unwrap_err().contains("another model"));
        assert!(load(&side, &shape(4)).unwrap_err().contains("3-wide"));
        side.set(keys::A, Value::F32s(vec![0.0; 9]));
        assert!(load(&side, &shape(3)).unwrap_err().contains("18 finite"));
        let mut nan = head.a.clone();
        nan[5] = f32::NAN;
        side.set(keys::A, Value::F32s(nan));
        assert!(load(&side, &shape(3)).is_err());
    }
}
