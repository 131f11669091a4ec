//! Leap's speculative-decoding engine: retrieval drafting with a suffix automaton, in-context
//! calibration, draft reuse, draft models, gain/cost token trees verified in one target pass,
//! and the analytic controller that decides when speculation pays.
//!
//! | module | owns |
//! |---|---|
//! | [`engine`] | [`engine::Engine`]: the loop: draft, build a tree, verify it in one call, accept, roll the KV cache back |
//! | [`draft`] | the [`draft::Drafter`] trait; retrieval from the request and the history, draft reuse |
//! | [`corpus`] | retrieval from the model's own answers to other prompts, shipped in its sidecar |
//! | [`calib`] | in-context calibration from the prompt's prefill |
//! | [`model_draft`] | drafting with a small model, across vocabularies through text |
//! | [`exit`] | verification pruning with an early-exit head (Lever §4.3), the head in the sidecar |
//! | [`lever`] | gain/cost token trees |
//! | [`control`] | the analytic model: acceptance per match length, the measured cost of rows |
//! | [`accept`] | greedy and stochastic (distribution-preserving) acceptance over a token tree |
//! | [`dist`] | llama.cpp's top-k/top-p/min-p/temperature chain |
//! | [`head`] | early-exit heads (Lever §4.3): the head, its training |
//! | [`ahead`] | a head that guesses the token after next from the final hidden state and the next token |
//! | [`tree`] | token trees, the rows of their one-call verification (leaf sequence ids), KV rollback plans |
//! | [`sam`] | the suffix automaton over token ids that retrieval drafting queries |
//! | [`vocab`] | on a streamed output projection (flash): the target drafting for itself over a resident vocabulary |
//! | [`hosted`] | drafting for a host that verifies itself (llama.cpp's `--spec-type leap`, through the C API) |
//! | [`session`] | the API every front end uses: [`session::Runtime`] (an open model), [`session::Session`] (a context and its engine) |
//! | [`text`] | a generation's bytes as complete UTF-8, for the front ends |
//! | [`plain`] | plain decoding (the baseline), [`plain::Generation`]: what a generation produced and cost |
//!
//! The crate is safe Rust on `leap-host`.

#![forbid(unsafe_code)]

pub mod accept;
pub mod ahead;
pub mod calib;
pub mod control;
pub mod corpus;
pub mod dist;
pub mod draft;
pub mod engine;
pub mod exit;
pub mod head;
pub mod hosted;
pub mod lever;
pub mod model_draft;
pub mod plain;
pub mod sam;
pub mod session;
pub mod text;
pub mod tree;
pub mod vocab;
