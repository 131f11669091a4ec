//! `leap bench` end to end on the real models: the report follows the contract, the modes
//! run interleaved, llama.cpp's speculative types are driven correctly, and bad
//! configurations fail with messages that say what to do.

use std::io::Write;
use std::path::PathBuf;

use leap_cli::bench::{self, report, BenchConfig};
use leap_host::sampler::SamplingParams;
use leap_host::FlashAttn;
use leap_tests::{model_path, threads, GEMMA, SMOLLM};

/// A small workload of real-looking requests; repetitive text gives the n-gram drafters work.
fn workload(max_tokens: usize) -> tempfile::NamedTempFile {
    let doc = "The apt-get command installs packages. The apt-get command removes packages. \
               The apt-get command upgrades packages. The dpkg command installs a .deb file.";
    let reqs = [
        (
            "s1",
            "summary",
            format!("{doc}\n\nSummary of the text above:"),
        ),
        (
            "r1",
            "rag",
            format!("{doc}\n\nQuestion: which command installs a .deb file?\nAnswer:"),
        ),
        (
            "c1",
            "code",
            "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".to_string(),
        ),
    ];
    let mut f = tempfile::NamedTempFile::new().unwrap();
    for (id, task, prompt) in reqs {
        let line =
            serde_json::json!({"id": id, "task": task, "prompt": prompt, "max_tokens": max_tokens});
        writeln!(f, "{line}").unwrap();
    }
    f
}

// The tests here run one at a time: the flash test measures the model file's residency,
// which another test decoding the same model in this process would fill.
use leap_tests::one_at_a_time as serial;

fn config(model: &str, workload: PathBuf, modes: &[&str]) -> BenchConfig {
    BenchConfig {
        model: model_path(model),
        draft: None,
        workload,
        limit: None,
        skip: 0,
        server_bin: None,
        tasks: vec![],
        modes: modes.iter().map(|s| s.to_string()).collect(),
        threads: threads(),
        sidecar: None,
        exit_threshold: None,
        ctx: 1024,
        flash_attn: FlashAttn::Auto,
        flash_budget: None,
        flash_strategy: Default::default(),
        sampling: SamplingParams::default(),
        progress: false,
        kernels: leap_tests::kernels(),
    }
}

#[test]
fn report_follows_the_contract_for_plain_and_every_ngram_type() {
    let _serial = serial();
    let w = workload(24);
    let modes = [
        "plain",
        "llama:ngram-simple",
        "llama:ngram-map-k",
        "llama:ngram-map-k4v",
        "llama:ngram-mod",
        "llama:ngram-cache",
    ];
    let r = bench::run(&config(GEMMA, w.path().to_path_buf(), &modes)).unwrap();
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(report::validate(&v), Vec::<String>::new());
    assert_eq!(r.n_requests, 3);
    assert_eq!(r.modes.len(), modes.len());
    for (name, m) in &r.modes {
        assert_eq!(m.requests.len(), 3, "{name}");
        assert!(
            m.identical_to_plain.is_some(),
            "{name}: greedy run with plain present"
        );
        for q in &m.requests {
            assert!(
                q.generated_tokens >= 1 && q.generated_tokens <= 24,
                "{name} {}",
                q.id
            );
            assert!(
                q.target_calls as usize <= q.generated_tokens,
                "{name}: at least one token per call"
            );
        }
    }
    let plain = &r.modes["plain"];
    assert_eq!(plain.drafted_tokens, 0);
    assert_eq!(plain.identical_to_plain, Some(true));
    // The request order within each mode is the workload's.
    let ids: Vec<_> = plain.requests.iter().map(|q| q.id.as_str()).collect();
    assert_eq!(ids, ["s1", "r1", "c1"]);
    // Somebody drafted something on this repetitive text.
    assert!(r.modes.values().any(|m| m.drafted_tokens > 0));
}

#[test]
fn too_long_requests_are_skipped_and_counted() {
    let _serial = serial();
    // The code request's short prompt and 30 tokens fit 64; the two over a paragraph do not.
    let w = workload(30);
    let mut cfg = config(SMOLLM, w.path().to_path_buf(), &["plain"]);
    cfg.ctx = 64;
    let r = bench::run(&cfg).unwrap();
    assert_eq!((r.n_requests, r.n_skipped), (1, 2));
    // When no request fits there is nothing to measure: an error that says what to change.
    let w = workload(2000);
    let mut cfg = config(SMOLLM, w.path().to_path_buf(), &["plain"]);
    cfg.ctx = 1024;
    let e = bench::run(&cfg).unwrap_err().to_string();
    assert!(e.contains("none of the 3 requests fits --ctx 1024"), "{e}");
}

#[test]
fn draft_simple_runs_with_a_same_vocabulary_draft() {
    let _serial = serial();
    let w = workload(16);
    let mut cfg = config(
        SMOLLM,
        w.path().to_path_buf(),
        &["plain", "llama:draft-simple"],
    );
    cfg.draft = Some(model_path(SMOLLM));
    let r = bench::run(&cfg).unwrap();
    let d = &r.modes["llama:draft-simple"];
    assert!(d.drafted_tokens > 0);
    // A model drafting for itself is accepted far more often than not.
    assert!(
        d.mean_accepted_per_call > 1.5,
        "{}",
        d.mean_accepted_per_call
    );
    assert_eq!(r.draft.as_deref(), Some("SmolLM2-135M-Instruct.Q4_1.gguf"));
}

#[test]
fn llama_refuses_a_draft_of_another_vocabulary() {
    let _serial = serial();
    let w = workload(8);
    let mut cfg = config(GEMMA, w.path().to_path_buf(), &["llama:draft-simple"]);
    cfg.draft = Some(model_path(SMOLLM));
    let e = format!("{:#}", bench::run(&cfg).unwrap_err());
    assert!(e.contains("vocab"), "{e}");
}

#[test]
fn bad_configurations_say_what_to_do() {
    let _serial = serial();
    let w = workload(8);
    let e = format!(
        "{:#}",
        bench::run(&config(
            GEMMA,
            w.path().to_path_buf(),
            &["llama:draft-simple"]
        ))
        .unwrap_err()
    );
    assert!(e.contains("--draft"), "{e}");
    let e = format!(
        "{:#}",
        bench::run(&config(GEMMA, w.path().to_path_buf(), &["turbo"])).unwrap_err()
    );
    assert!(e.contains("unknown mode"), "{e}");
}

#[test]
fn flash_budget_streams_and_reports_storage_reads() {
    let _serial = serial();
    let w = workload(8);
    let mut c = config(GEMMA, w.path().to_path_buf(), &["plain", "leap"]);
    c.flash_budget = Some(0.25);
    let r = bench::run(&c).expect("bench under a flash budget");
    assert_eq!(r.flash_budget, Some(0.25));
    for m in ["plain", "leap"] {
        let read = r.modes[m]
            .storage_read_bytes
            .expect("measured under a budget");
        // Each decode call streams the non-resident blocks and the output projection.
        let per_token = read as f64 / r.modes[m].generated_tokens.max(1) as f64;
        assert!(
            per_token > 10e6,
            "{m}: {per_token} bytes a token from storage"
        );
    }
    assert_eq!(r.modes["leap"].identical_to_plain, Some(true));
    // Resident weights stay within the budget, with one streamed block of slack (the
    // block or chunk computing and the one read ahead fill the planner's window).
    let map = leap_flash::LayerMap::open(&c.model).expect("layer map");
    let budget = map.per_call_bytes() / 4;
    for m in ["plain", "leap"] {
        let peak = r.modes[m].flash_peak_resident_bytes.expect("measured");
        assert!(
            peak <= budget + map.largest_block(),
            "{m}: {peak} bytes resident for a budget of {budget}"
        );
    }
    // Lever's Table 6 from a sweep: a text table and a PNG chart.
    c.flash_budget = Some(1.0);
    let whole = bench::run(&c).expect("bench with everything resident");
    let m = &whole.modes["plain"];
    let per_token = m.storage_read_bytes.expect("measured") as f64 / m.generated_tokens as f64;
    assert!(
        per_token < 1e6,
        "all resident, yet {per_token} bytes a token read"
    );
    let modes = ["plain".to_string(), "leap".to_string()];
    let dir = tempfile::tempdir().expect("tempdir");
    let chart = dir.path().join("t6.png");
    let table = bench::sweep(&[r, whole], &modes, &chart).expect("sweep");
    assert!(table.contains("0.25") && table.contains("vs AR"), "{table}");
    let png = std::fs::read(&chart).expect("chart written");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    c.flash_budget = Some(1.5);
    let e = format!("{:#}", bench::run(&c).unwrap_err());
    assert!(e.contains("--flash-budget"), "{e}");
}

#[test]
fn oracle_drafts_plain_answers_and_needs_plain_first() {
    let _serial = serial();
    let w = workload(48);
    let r = bench::run(&config(
        SMOLLM,
        w.path().to_path_buf(),
        &["plain", "leap:oracle"],
    ))
    .unwrap();
    let (plain, o) = (&r.modes["plain"], &r.modes["leap:oracle"]);
    assert_eq!(o.identical_to_plain, Some(true));
    // Every draft is plain's next tokens: after the first calls (the controller learns what
    // a draft is worth) most calls accept many tokens.
    assert_eq!(o.generated_tokens, plain.generated_tokens);
    assert!(
        o.target_calls * 3 < plain.target_calls,
        "oracle calls {} against plain's {}",
        o.target_calls,
        plain.target_calls
    );
    for modes in [&["leap:oracle", "plain"][..], &["leap:oracle"][..]] {
        let e = format!(
            "{:#}",
            bench::run(&config(SMOLLM, w.path().to_path_buf(), modes)).unwrap_err()
        );
        assert!(e.contains("put plain before it"), "{e}");
    }
    let mut cfg = config(SMOLLM, w.path().to_path_buf(), &["plain", "leap:oracle"]);
    cfg.sampling.temp = 0.8;
    let e = format!("{:#}", bench::run(&cfg).unwrap_err());
    assert!(e.contains("--temp 0"), "{e}");
}
