//! The modes `leap bench` runs, by name: `plain`, `llama:TYPE`, `server:TYPE`, and `leap` or
//! `leap:NAME` with Leap's named engine configurations.

use anyhow::{bail, Context as _, Result};
use leap_host::anchor::TYPES;
use leap_spec::engine::EngineConfig;

use super::stock;

/// A mode, parsed from its name.
#[derive(Debug, Clone, PartialEq)]
pub enum ModeKind {
    /// `plain`.
    Plain,
    /// `llama:TYPE`.
    Llama(String),
    /// `server:TYPE`: a stock llama-server in its own process ([`stock`]).
    Server(String),
    /// `leap` or `leap:NAME`: Leap's engine with a named configuration.
    Leap(EngineConfig),
}

/// Leap's named configurations (`leap:NAME`); `leap` is the recommended one.
pub const LEAP_CONFIGS: &[&str] = &[
    "sam",
    "sam-fixed",
    "history",
    "reuse",
    "calib",
    "tree",
    "eager",
    "ondemand",
    "exit-measure",
    "ggml",
    "draft",
    "vocab",
    "oracle",
    "no-corpus",
];

/// The engine configuration of `leap` (`None`) or `leap:NAME`. The named ones add one
/// technique at a time, so a bench run shows each one's contribution:
/// `sam` (retrieval from the request only, Lever trees of one leaf), `sam-fixed` (the same
/// drafting the longest continuation every step), `history` (+ earlier requests and answers),
/// `reuse` (+ draft reuse), `calib` (+ in-context calibration: `leap`'s trees where it builds
/// them), `tree` (+ up to 4 leaves per step, and the sidecar's early-exit head); `eager`,
/// `ondemand` and `exit-measure` verify `tree`'s trees with llama.cpp computing logits for
/// every verified row, with on-demand output projection alone, and with the head deciding
/// without pruning; `ggml` is `calib` with verification's matrix products on ggml's CPU
/// kernels instead of Leap's device; `draft` is `calib` drafting with a draft model too
/// (`--draft`); `vocab` is `calib` drafting with the target itself over a resident vocabulary;
/// `oracle` is `sam` drafting plain decoding's answers ([`super::oracle`]); `no-corpus` is
/// `leap` without the sidecar's answers ([`leap_spec::corpus`]), which only `leap` drafts from.
pub fn leap_config(name: Option<&str>) -> Option<EngineConfig> {
    // Only `leap` itself (and `leap:tree`, which is `leap` with wider trees) prunes with an
    // early-exit head when the sidecar has one: every other named configuration shows its
    // technique without it.
    // Only `leap` drafts with the target itself when that pays (on a streamed target, or
    // where the output projection is a large share of a call), and `leap:vocab` always: the
    // other named configurations show their trees.
    let base = EngineConfig {
        exit: name.is_none() || name == Some("tree"),
        vocab: None,
        corpus: false,
        ..EngineConfig::default()
    };
    let sam = EngineConfig {
        history_tokens: 0,
        reuse_lifetime: 0,
        calibrate: false,
        ..base.clone()
    };
    Some(match name {
        None => EngineConfig::default(),
        Some("no-corpus") => EngineConfig {
            corpus: false,
            ..EngineConfig::default()
        },
        Some("sam") => sam,
        Some("sam-fixed") => EngineConfig {
            adaptive: false,
            max_draft: 8,
            ..sam
        },
        Some("history") => EngineConfig {
            reuse_lifetime: 0,
            calibrate: false,
            ..base
        },
        Some("reuse") => EngineConfig {
            calibrate: false,
            ..base
        },
        Some("calib") => base,
        Some("tree") => EngineConfig {
            max_branches: 4,
            ..base
        },
        // Issue 7's modes verify Lever's trees (up to 4 leaves, as `leap:tree`), which is
        // where skipping rows pays: `eager` with llama.cpp computing every verified row's
        // logits, `ondemand` projecting only the rows acceptance reads (no early-exit head),
        // `exit-measure` with the sidecar's head deciding on every tree without pruning (what
        // it would keep, and how many accepted tokens that would have kept, on the same
        // trees). `leap:tree` is the three together.
        Some("eager") => EngineConfig {
            on_demand: false,
            max_branches: 4,
            ..base
        },
        Some("ondemand") => EngineConfig {
            max_branches: 4,
            ..base
        },
        Some("exit-measure") => EngineConfig {
            exit: true,
            max_branches: 4,
            prune: leap_spec::exit::PruneConfig {
                measure_only: true,
                ..base.prune.clone()
            },
            ..base
        },
        // `calib` on llama.cpp's kernels alone (see `BenchConfig::kernels`).
        Some("ggml") => base,
        // `calib` plus a draft model (`--draft`), across vocabularies if need be.
        Some("draft") => base,
        // The target drafting for itself over a resident vocabulary, with resident weights
        // too (`leap` does it on a streamed target).
        Some("vocab") => EngineConfig {
            vocab: Some(leap_spec::vocab::VocabConfig {
                resident: leap_spec::vocab::Resident::Always,
                ..Default::default()
            }),
            ..base
        },
        // Chains of plain's own answer (see [`oracle`]): the ceiling of any drafter here.
        Some("oracle") => sam,
        Some(_) => return None,
    })
}

impl ModeKind {
    /// Parse a mode name.
    ///
    /// # Errors
    /// Unknown names, and Leap modes that do not exist yet.
    pub fn parse(name: &str) -> Result<Self> {
        if name == "plain" {
            return Ok(ModeKind::Plain);
        }
        if let Some(t) = name.strip_prefix("llama:") {
            if TYPES.contains(&t) {
                return Ok(ModeKind::Llama(t.to_string()));
            }
            bail!(
                "unknown llama.cpp speculative type {t:?}; one of: {}",
                TYPES.join(", ")
            );
        }
        if let Some(t) = name.strip_prefix("server:") {
            if stock::server_types().contains(&t) {
                return Ok(ModeKind::Server(t.to_string()));
            }
            bail!(
                "unknown stock llama-server mode {name:?}; one of: server:{}",
                stock::server_types().join(", server:")
            );
        }
        if name == "leap" || name.starts_with("leap:") {
            let known = || {
                LEAP_CONFIGS
                    .iter()
                    .map(|c| format!("leap:{c}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return leap_config(name.strip_prefix("leap:"))
                .map(ModeKind::Leap)
                .with_context(|| {
                    format!(
                        "unknown Leap configuration {name:?}; one of: leap, {}",
                        known()
                    )
                });
        }
        bail!(
            "unknown mode {name:?}; modes are plain, llama:TYPE ({}), server:TYPE ({}), leap, \
             leap:NAME ({})",
            TYPES.join(", "),
            stock::server_types().join(", "),
            LEAP_CONFIGS.join(", ")
        )
    }
}

/// The modes `cfg` asks for, checked against each other and the run's settings: an exit
/// threshold applied to every Leap mode, `leap:oracle` after `plain` and greedy, a draft model
/// where a mode needs one, no `server:*` mode under flash.
pub(super) fn parse_all(cfg: &super::BenchConfig) -> Result<Vec<ModeKind>> {
    let kinds: Vec<ModeKind> = cfg
        .modes
        .iter()
        .map(|m| ModeKind::parse(m))
        .map(|k| match (k, cfg.exit_threshold) {
            (Ok(ModeKind::Leap(mut ec)), Some(t)) => {
                ec.prune.threshold = t;
                Ok(ModeKind::Leap(ec))
            }
            (k, _) => k,
        })
        .collect::<Result<_>>()?;
    let needs_draft = kinds
        .iter()
        .any(|k| *k == ModeKind::Llama("draft-simple".into()))
        || cfg.modes.iter().any(|m| m == "leap:draft");
    if let Some(o) = cfg.modes.iter().position(|m| m == "leap:oracle") {
        anyhow::ensure!(
            cfg.modes[..o].iter().any(|m| m == "plain"),
            "leap:oracle drafts plain decoding's answers: put plain before it in --modes"
        );
        anyhow::ensure!(
            cfg.sampling.is_greedy(),
            "leap:oracle drafts plain's greedy answers: it runs with --temp 0 only"
        );
    }
    if needs_draft && cfg.draft.is_none() {
        bail!("modes llama:draft-simple and leap:draft need a draft model: pass --draft PATH");
    }
    let servers = kinds.iter().any(|k| matches!(k, ModeKind::Server(_)));
    if servers && cfg.flash_budget.is_some() {
        bail!("server:* modes cannot stream weights: run them without --flash-budget");
    }
    Ok(kinds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_names_parse() {
        assert_eq!(ModeKind::parse("plain").unwrap(), ModeKind::Plain);
        assert_eq!(
            ModeKind::parse("llama:ngram-mod").unwrap(),
            ModeKind::Llama("ngram-mod".into())
        );
        assert!(ModeKind::parse("llama:eagle9")
            .unwrap_err()
            .to_string()
            .contains("ngram-simple"));
        assert!(ModeKind::parse("fast").is_err());
        assert_eq!(
            ModeKind::parse("leap").unwrap(),
            ModeKind::Leap(EngineConfig::default())
        );
        assert!(
            matches!(ModeKind::parse("leap:tree").unwrap(), ModeKind::Leap(c) if c.max_branches > 1)
        );
        assert_eq!(
            ModeKind::parse("server:ngram-mod").unwrap(),
            ModeKind::Server("ngram-mod".into())
        );
        assert_eq!(
            ModeKind::parse("server:none").unwrap(),
            ModeKind::Server("none".into())
        );
        assert!(ModeKind::parse("server:leap")
            .unwrap_err()
            .to_string()
            .contains("server:ngram-mod"));
        assert!(ModeKind::parse("leap:warp")
            .unwrap_err()
            .to_string()
            .contains("leap:sam"));
    }
}
