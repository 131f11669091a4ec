//! Leap's speculative-decoding engine: retrieval drafting with a suffix automaton, in-context
//! calibration, draft reuse, draft models, gain/cost token trees verified in one target pass,
//! and the analytic controller that decides when speculation pays.
//!
//! **Work in progress.** What exists so far:
//!
//! | module | owns |
//! |---|---|
//! | [`accept`] | greedy and stochastic (distribution-preserving) acceptance over a token tree |
//! | [`control`] | the analytic model: draft length from measured acceptance and row cost |
//! | [`engine`] | [`engine::Engine`]: SAM drafting, one-call tree verification, greedy acceptance, KV rollback |
//! | [`plain`] | plain decoding (the baseline), [`plain::Generation`]: what a generation produced and cost |
//! | [`sam`] | the suffix automaton over token ids that retrieval drafting queries |
//! | [`tree`] | token trees, the rows of their one-call verification (leaf sequence ids), KV rollback plans |
//!
//! Not yet: in-context calibration, draft reuse, draft models, Lever's gain/cost tree
//! construction, sampled speculative decoding in the engine. The crate is safe Rust on
//! `leap-host`.

#![forbid(unsafe_code)]

pub mod accept;
pub mod calib;
pub mod control;
pub mod dist;
pub mod draft;
pub mod engine;
pub mod lever;
pub mod plain;
pub mod sam;
pub mod tree;
