//! Leap's speculative-decoding engine: retrieval drafting with a suffix automaton, in-context
//! calibration, draft reuse, draft models, gain/cost token trees verified in one target pass,
//! and the analytic controller that decides when speculation pays.
//!
//! **Nothing is implemented here yet.** The crate exists so the workspace has its final shape;
//! `leap bench` refuses the `leap` and `leap:*` modes until the engine lands (see the
//! speculative-engine issue). It will be safe Rust on `leap-host`.
#![forbid(unsafe_code)]
