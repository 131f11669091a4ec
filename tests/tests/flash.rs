//! The flash layer on the real Gemma 3 270M file: its layer map, budget plans, and residency
//! control measured with `mincore` (no model is loaded in this test binary, so nothing else
//! maps the file's pages).

use leap_flash::{io_read_bytes, plan, LayerMap, Pages, Section, Strategy};
use leap_host::GgufInfo;
use leap_tests::model_path;

#[test]
fn the_layer_map_covers_every_tensor_once() {
    let path = model_path("gemma3-270m");
    let info = GgufInfo::open(&path).expect("gguf");
    let map = LayerMap::from_info(&info);
    assert_eq!(map.blocks(), 18);
    assert!(
        map.tied_output,
        "Gemma 3 ties its output projection to the embeddings"
    );
    assert_eq!(map.bytes(Section::Output), 0);
    // Every tensor lies in exactly one section's ranges.
    for t in &info.tensors {
        let hits = map
            .sections
            .iter()
            .flat_map(|(_, r)| r)
            .filter(|r| r.start <= t.offset && t.offset + t.size <= r.end)
            .count();
        assert_eq!(hits, 1, "{}", t.name);
    }
    // Merging only swallows alignment padding.
    let total = map.total();
    assert!(total >= info.tensor_bytes() && total - info.tensor_bytes() < 64 * 1024);
    // The embedding matrix (262144 x 640, Q8_0) is most of this model.
    let embed = map.bytes(Section::Embed) as f64 / total as f64;
    assert!((0.6..0.8).contains(&embed), "{embed}");
    assert_eq!(map.per_call().len(), 20);
}

// Tests that read the real model file (copying it fills its page cache) run one at a time:
// the streaming test measures that file's residency.
use leap_tests::one_at_a_time as serial;

#[test]
fn plans_respect_the_budget() {
    let map = LayerMap::open(&model_path("gemma3-270m")).expect("map");
    let total = map.per_call_bytes();
    let chunk = 8 << 20;
    for strategy in [Strategy::FirstLayers, Strategy::OutputFirst, Strategy::Fill] {
        let mut last = 0;
        for f in [0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.2] {
            let budget = (total as f64 * f) as u64;
            let p = plan(&map, budget, chunk, 1, strategy);
            assert!(p.pinned_bytes + p.window <= budget.max(map.bytes(Section::Rest) + p.window));
            assert_eq!(p.pinned_bytes + p.streamed_bytes, total, "{strategy:?} {f}");
            assert!(p.pinned_bytes >= last, "more budget never pins less");
            last = p.pinned_bytes;
            if strategy == Strategy::FirstLayers {
                // A prefix of the blocks.
                let blocks: Vec<usize> = p
                    .pinned
                    .iter()
                    .filter_map(|s| match s {
                        Section::Block(i) => Some(*i),
                        _ => None,
                    })
                    .collect();
                assert_eq!(blocks, (0..blocks.len()).collect::<Vec<_>>());
            }
        }
        let none = plan(&map, 0, chunk, 1, strategy);
        assert_eq!(none.window, 0);
        let all = plan(&map, total + 2 * chunk, chunk, 1, strategy);
        assert!(all.streamed.is_empty(), "{strategy:?}: {:?}", all.streamed);
    }
    // Fill (the default) never reads more a call than the whole-section strategies, and
    // at half the weights, where neither can pin the output projection, much less.
    for f in [0.1, 0.25, 0.5, 0.75, 0.9, 1.0] {
        let budget = (total as f64 * f) as u64;
        let fill = plan(&map, budget, chunk, 1, Strategy::Fill);
        for other in [Strategy::FirstLayers, Strategy::OutputFirst] {
            let o = plan(&map, budget, chunk, 1, other);
            assert!(fill.streamed_bytes <= o.streamed_bytes, "{f} {other:?}");
            if f == 0.5 {
                assert!(
                    fill.streamed_bytes + (30 << 20) < o.streamed_bytes,
                    "{f} {other:?}"
                );
            }
        }
        assert!(fill.pinned_bytes + fill.window <= budget.max(map.bytes(Section::Rest)) + 4096);
    }
    assert_eq!(Strategy::default(), Strategy::Fill);
    // At a quarter of the weights, the output projection (70%) cannot be resident.
    let q = plan(&map, total / 4, chunk, 1, Strategy::OutputFirst);
    assert!(q.streamed.contains(&Section::Embed));
    assert!(q.pinned.iter().any(|s| matches!(s, Section::Block(_))));
}

/// A scratch file on disk (cargo's target tmp dir, not a tmpfs), mapped by nobody else.
fn scratch(name: &str, bytes: usize) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(name);
    let mut rng = leap_kernels::rng::XorShift::new(0x9E37_79B9_7F4A_7C15);
    let data: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
    let mut f = std::fs::File::create(&path).expect("scratch file");
    std::io::Write::write_all(&mut f, &data).expect("scratch file");
    // Clean pages: the kernel does not drop dirty ones.
    f.sync_all().expect("sync");
    path
}

#[test]
fn pages_are_evicted_and_loaded_for_real() {
    let _serial = serial();
    let path = scratch("flash-pages.bin", 40 << 20);
    let pages = Pages::open(&path).expect("pages");
    let r = (3 << 20) + 100..(19 << 20) + 5;
    let bytes = r.end - r.start;
    pages.evict(0..pages.len()).expect("evict");
    let after_evict = pages.resident(r.clone()).expect("mincore");
    assert!(
        after_evict * 10 < bytes,
        "evicted, {after_evict} of {bytes} bytes still resident"
    );
    let read0 = io_read_bytes();
    let loaded = pages.load(r.clone()).expect("load");
    assert!(loaded >= bytes);
    let resident = pages.resident(r.clone()).expect("mincore");
    assert!(resident >= bytes, "{resident} < {bytes}");
    if let (Some(a), Some(b)) = (read0, io_read_bytes()) {
        // Read from storage, not from the page cache.
        assert!(
            b - a >= bytes / 2,
            "read {} of {bytes} bytes from storage",
            b - a
        );
    }
    // Only the range asked for was loaded (the kernel's readahead reaches a few MB past it).
    let tail = r.end + (12 << 20)..pages.len();
    let rest = pages.resident(tail.clone()).expect("mincore");
    assert!(
        rest * 2 < tail.end - tail.start,
        "{rest} bytes far past the range resident"
    );
    pages.evict(r.clone()).expect("evict");
    assert!(pages.resident(r).expect("mincore") * 10 < bytes);
    // The real model maps and reports residency too.
    let model = Pages::open(&model_path("gemma3-270m")).expect("model pages");
    let map = LayerMap::open(&model_path("gemma3-270m")).expect("map");
    let b0 = map.ranges(Section::Block(0))[0].clone();
    model.load(b0.clone()).expect("load");
    assert!(model.resident(b0.clone()).expect("mincore") >= b0.end - b0.start);
}

#[test]
fn a_truncated_model_is_an_error_not_a_crash() {
    let _serial = serial();
    let path = model_path("gemma3-270m");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let copy = dir.path().join("model.gguf");
    std::fs::copy(&path, &copy).expect("copy");
    let map = LayerMap::open(&copy).expect("map");
    let pages = Pages::open(&copy).expect("pages");
    let last = map.ranges(Section::Block(17))[0].clone();
    // Truncated after mapping: reading the lost range would be SIGBUS.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&copy)
        .expect("open");
    f.set_len(last.start).expect("truncate");
    let err = pages.load(last).expect_err("outside the file now");
    let msg = err.to_string();
    assert!(msg.contains("truncated or replaced"), "{msg}");
    // What is still there reads fine.
    pages.load(0..4096).expect("the header");
}

/// Greedy decoding at a quarter of the weights (blocks and the output projection streamed)
/// gives plain decoding's tokens, really reads from storage every call, and keeps the
/// streamed bytes resident within the window at every layer and output-chunk boundary:
/// Leap's projection reads the output weights a chunk at a time. The call that checks it
/// against llama.cpp's projection (one node) is flagged and has the output resident whole.
#[test]
fn streamed_decoding_keeps_the_tokens_and_the_budget() {
    let _serial = serial();
    // The output chunks read with O_DIRECT into Leap's pool, and through the page cache.
    for direct in [true, false] {
        streamed_decoding(direct);
    }
}

fn streamed_decoding(direct: bool) {
    use leap_flash::Streamer;
    use leap_host::project::OnDemand;
    let path = model_path("gemma3-270m");
    let model = leap_tests::model("gemma3-270m");
    let prompt = model
        .tokenize(
            "The three most useful things to know about a phone are",
            true,
            false,
        )
        .expect("tokens");
    let want = {
        let mut ctx = leap_tests::context("gemma3-270m", 512, 1);
        leap_tests::plain_greedy(&mut ctx, &prompt, 12).tokens
    };
    let map = LayerMap::open(&path).expect("map");
    let total = map.per_call_bytes();
    let chunk = map.largest_block();
    let output = map.bytes(Section::Embed) + map.bytes(Section::Output);
    let p = plan(&map, total / 4, chunk, 1, Strategy::FirstLayers);
    let streamed_blocks = p
        .streamed
        .iter()
        .filter(|s| matches!(s, Section::Block(_)))
        .count();
    assert!(streamed_blocks > 0, "{p:?}");
    assert!(
        p.streamed.contains(&Section::Embed),
        "the tied output projection streams: {p:?}"
    );
    let (window, pinned, budget) = (p.window, p.pinned_bytes, p.budget);
    let streamer = Streamer::new(&path, map, p, 1)
        .expect("streamer")
        .measure_every(1)
        .direct(direct);
    let (mut ctx, od) = OnDemand::context_with(
        &model,
        &leap_tests::params(512, 1),
        Some(streamer.observer()),
    )
    .expect("context");
    let od = streamer.stream_projection(od.expect("Gemma's projection is a plain matrix product"));
    assert!(od.streamed());
    // Where the file system refuses O_DIRECT (tmpfs), the page cache path runs instead.
    if direct && !streamer.reads_direct() {
        eprintln!(
            "no O_DIRECT for {}: read through the page cache",
            path.display()
        );
    }
    assert!(direct || !streamer.reads_direct());
    let greedy = leap_host::sampler::SamplingParams::default();
    let got =
        leap_spec::plain::plain_with(&mut ctx, Some(&od), &prompt, 12, &greedy, 512, &mut |_| {
            true
        })
        .expect("streamed decoding")
        .tokens;
    assert_eq!(got, want, "streaming changed the tokens");
    streamer.flush();
    let calls = streamer.calls();
    assert!(calls.len() >= 12, "{} calls seen", calls.len());
    let checks = calls.iter().filter(|c| c.llama_output).count();
    // The prompt's pass and the first step's check ran llama.cpp's projection.
    assert!(
        (1..=2).contains(&checks),
        "{checks} calls ran llama.cpp's projection"
    );
    for (k, c) in calls.iter().enumerate() {
        if c.llama_output {
            assert!(c.peak_streamed_resident >= output / 2, "call {k}: {c:?}");
            continue;
        }
        // The block or chunk computing and the one read ahead, with a block of slack.
        assert!(
            c.peak_streamed_resident <= window + chunk,
            "call {k}: {} resident, window {window}",
            c.peak_streamed_resident
        );
        assert!(
            pinned + c.peak_streamed_resident <= budget + chunk,
            "call {k}: {c:?}"
        );
        if io_read_bytes().is_some() && k > 0 {
            assert!(
                c.read_bytes >= output / 2,
                "call {k} read {} bytes from storage",
                c.read_bytes
            );
        }
    }
    eprintln!(
        "streamed {streamed_blocks} blocks and the output (direct {direct}): {:?}",
        &calls[calls.len() - 3..]
    );
}

/// A streamed decode of a model whose file is truncated, or deleted, during the run stops
/// with an error that says so (no SIGBUS, no tokens from missing weights).
#[test]
fn a_model_file_changed_mid_run_stops_decoding_with_a_clear_error() {
    let _serial = serial();
    use leap_flash::Streamer;
    use leap_host::project::OnDemand;
    let path = model_path("gemma3-270m");
    let greedy = leap_host::sampler::SamplingParams::default();
    for damage in ["truncate", "delete"] {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
        let copy = dir.path().join("model.gguf");
        std::fs::copy(&path, &copy).expect("copy");
        let model = leap_host::Model::load(&copy, &Default::default()).expect("model");
        let prompt = model.tokenize("Streams of", true, false).expect("tokens");
        let map = LayerMap::open(&copy).expect("map");
        let p = plan(
            &map,
            map.per_call_bytes() / 4,
            map.largest_block(),
            1,
            Strategy::FirstLayers,
        );
        let streamer = Streamer::new(&copy, map.clone(), p, 1).expect("streamer");
        let (mut ctx, od) = OnDemand::context_with(
            &model,
            &leap_tests::params(256, 1),
            Some(streamer.observer()),
        )
        .expect("context");
        let od = streamer.stream_projection(od.expect("projection"));
        let first = leap_spec::plain::plain_with(
            &mut ctx,
            Some(&od),
            &prompt,
            3,
            &greedy,
            256,
            &mut |_| true,
        );
        assert_eq!(first.expect("intact file").tokens.len(), 3);
        match damage {
            "truncate" => {
                let last = map.ranges(Section::Block(17))[0].clone();
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&copy)
                    .expect("open")
                    .set_len(last.start)
                    .expect("truncate");
            }
            _ => std::fs::remove_file(&copy).expect("delete"),
        }
        let err = leap_spec::plain::plain_with(
            &mut ctx,
            Some(&od),
            &prompt,
            3,
            &greedy,
            256,
            &mut |_| true,
        )
        .expect_err("the file changed under the stream");
        let msg = err.to_string();
        let want = if damage == "truncate" {
            "truncated or replaced"
        } else {
            "deleted"
        };
        assert!(msg.contains(want), "{damage}: {msg}");
        // `leap`'s self-drafting on the streamed target stops the same way.
        let mut engine =
            leap_spec::engine::Engine::new(leap_spec::engine::EngineConfig::default().streamed())
                .with_on_demand(Some(od.clone()));
        let err = engine
            .generate(&mut ctx, &prompt, 3, 256, &mut |_| true)
            .expect_err("the file changed under the stream");
        let msg = err.to_string();
        assert!(msg.contains(want), "{damage}, self-drafting: {msg}");
    }
}

/// The other mappings of a model file are found with the address ranges really mapped, so
/// evictions through them never touch memory that is not the file's.
#[test]
fn other_mappings_of_the_model_are_found_with_their_areas() {
    let _serial = serial();
    let path = model_path("gemma3-270m");
    let _model = leap_tests::model("gemma3-270m");
    let pages = Pages::open(&path).expect("pages");
    let maps = leap_flash::mappings_of(&path, pages.address());
    assert!(!maps.is_empty(), "llama.cpp's mapping of the model");
    for m in &maps {
        assert_ne!(m.base, pages.address(), "ours is left out");
        for a in &m.areas {
            assert!(a.start >= m.base && a.start < a.end, "{m:?}");
            assert!(
                (a.end - m.base) as u64 <= pages.len().div_ceil(4096) * 4096,
                "an area past the file's end: {m:?}"
            );
        }
    }
}

/// On a streamed target `leap` drafts with the target itself over a resident vocabulary
/// (`leap_spec::vocab`): plain greedy decoding's tokens, with fewer passes over the streamed
/// output weights than tokens, within the budget less the resident rows. A resident
/// vocabulary of 16 rows (nearly every draft rejected) keeps the tokens too.
#[test]
fn self_drafting_on_a_streamed_target_keeps_the_tokens_and_the_budget() {
    use leap_flash::Streamer;
    use leap_host::project::OnDemand;
    use leap_spec::engine::{Engine, EngineConfig};
    use leap_spec::vocab::VocabConfig;
    let _serial = serial();
    let path = model_path("gemma3-270m");
    let model = leap_tests::model("gemma3-270m");
    let prompt = model
        .tokenize(
            "Write a Python function that returns the squares of a list of numbers.\n",
            true,
            false,
        )
        .expect("tokens");
    let n = 32;
    let want = {
        let mut ctx = leap_tests::context("gemma3-270m", 512, 1);
        leap_tests::plain_greedy(&mut ctx, &prompt, n).tokens
    };
    let map = LayerMap::open(&path).expect("map");
    let output = map.bytes(Section::Embed) + map.bytes(Section::Output);
    let row_bytes = output / model.n_vocab() as u64;
    let chunk = map.largest_block();
    for vc in [
        VocabConfig::default(),
        VocabConfig {
            prefix: 16,
            resident_prefix: 16,
            extra: 0,
            max_draft: 4,
            resident: leap_spec::vocab::Resident::Never,
            min_match: 2,
            always_guess: false,
        },
    ] {
        let budget = map.per_call_bytes() / 4;
        let reserve = vc.resident_rows() as u64 * row_bytes;
        let p = plan(&map, budget - reserve, chunk, 1, Strategy::Fill);
        let pinned = p.pinned_bytes;
        let streamer = Streamer::new(&path, map.clone(), p, 1)
            .expect("streamer")
            .measure_every(1);
        let (mut ctx, od) = OnDemand::context_with(
            &model,
            &leap_tests::params(512, 1),
            Some(streamer.observer()),
        )
        .expect("context");
        let od = streamer.stream_projection(od.expect("projection"));
        let mut engine = Engine::new(EngineConfig {
            vocab: Some(vc),
            ..EngineConfig::default().streamed()
        })
        .with_on_demand(Some(od));
        let g = engine
            .generate(&mut ctx, &prompt, n, 512, &mut |_| true)
            .expect("self-drafting");
        assert_eq!(g.tokens, want, "self-drafting changed the tokens ({vc:?})");
        assert!(g.drafted_tokens > 0, "{g:?}");
        streamer.flush();
        let calls = streamer.calls();
        let decode = &calls[calls.len() - g.target_calls as usize..];
        assert!(decode.iter().all(|c| !c.llama_output), "{decode:?}");
        for (k, c) in decode.iter().enumerate() {
            assert!(
                pinned + reserve + c.peak_streamed_resident <= budget + chunk,
                "call {k}: pinned {pinned} + rows {reserve} + {c:?} over {budget}"
            );
        }
        let read: u64 = decode.iter().map(|c| c.read_bytes).sum();
        eprintln!(
            "{vc:?}: {} tokens, {} calls, {} drafted, {:.1} MB read",
            g.tokens.len(),
            g.target_calls,
            g.drafted_tokens,
            read as f64 / 1e6
        );
        // Each pass over the output weights projects every drafted state at once.
        if vc.prefix > 16 && io_read_bytes().is_some() {
            assert!(
                read < output * n as u64 / 2,
                "{read} bytes read for {n} tokens: a pass per token"
            );
        }
    }
}
