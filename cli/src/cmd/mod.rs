//! The subcommands: each module owns its clap arguments and the function `main.rs` dispatches
//! to; the work itself lives in the library (`leap_cli`) where the tests in `tests/` reuse it.
//!
//! | module | owns |
//! |---|---|
//! | [`options`] | the option groups several subcommands flatten (`RuntimeArgs`, `SamplingArgs`), `--flash-budget` sizes |
//! | [`generate`] | `leap generate` |
//! | [`serve`] | `leap serve` |
//! | [`mod@bench`] | `leap bench` |
//! | [`models`] | `leap models`, `leap models fetch`, `leap models path` |
//! | [`profile`] | `leap profile` |
//! | [`attn`] | `leap attn-bench`, `leap perplexity`, `leap profile-heads`, `leap plugin-path` |
//! | [`train_heads`] | `leap train-heads` |
//! | [`corpus`] | `leap corpus` |
//! | [`info`] | `leap info`, with `--tensors` and `--flash-budget` |
//!
//! Standard output is written through a locked handle with `writeln!` and its errors returned,
//! never with `println!`, which panics when the reader has gone (`leap info MODEL --tensors |
//! head -1`): the broken pipe then ends the command, and `main` exits 0.

pub mod attn;
pub mod bench;
pub mod corpus;
pub mod generate;
pub mod info;
pub mod models;
pub mod options;
pub mod profile;
pub mod serve;
pub mod train_heads;
