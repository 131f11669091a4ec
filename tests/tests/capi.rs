//! Leap's C API as an app uses it: `tests/c/leap_example.c`, compiled here against
//! `include/leap.h` and `libleap.so` (`cargo build --release -p leap-capi`), generates on
//! SmolLM2 in both modes: Leap's greedy text is plain decoding's in no more target calls, a
//! callback that says stop ends the generation there, the log reaches the app's callback,
//! tokens go back to their text, a stop string cuts a conversation's answer, and a missing
//! model is an error with a message. The same example builds against `make install`'s tree
//! through pkg-config, and a cancel from another thread stops prompt processing.

use std::path::{Path, PathBuf};
use std::process::Command;

use leap_tests::{built_library, model_path, profile_dir, SMOLLM};

fn include_dir() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../include")
}

fn libleap() -> PathBuf {
    built_library("libleap.so", "leap-capi")
}

/// Compile the example against the header and libleap.so.
fn example(dir: &Path) -> PathBuf {
    example_with(dir, &[])
}

/// Compile the example with the header and library `flags` name (the build tree's when empty).
fn example_with(dir: &Path, flags: &[String]) -> PathBuf {
    libleap();
    let lib = profile_dir();
    let lib = lib.display();
    let llama = env!("LEAP_LLAMA_LIBDIR");
    let out = dir.join("leap_example");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut cmd = Command::new(&cc);
    let cmd = cmd
        .args([
            "-std=c99",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Wpedantic",
            "-Werror",
        ])
        .arg("-o")
        .arg(&out)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/c/leap_example.c"));
    let cmd = if flags.is_empty() {
        cmd.arg(format!("-I{}", include_dir()))
            .arg(format!("-L{lib}"))
            .arg("-lleap")
            // libleap.so's own DT_RPATH finds llama.cpp's libraries; the program's finds
            // libleap.
            .arg(format!(
                "-Wl,--disable-new-dtags,-rpath,{lib},-rpath,{llama}"
            ))
    } else {
        cmd.args(flags)
    };
    let status = cmd.status().unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(status.success(), "compiling leap_example.c failed");
    out
}

struct Run {
    text: String,
    stderr: String,
}

impl Run {
    /// The value of the stderr line `name VALUE`.
    fn stat(&self, name: &str) -> String {
        let prefix = format!("{name} ");
        self.stderr
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no `{name}` line in:\n{}", self.stderr))
            .trim()
            .to_string()
    }

    fn number(&self, name: &str) -> u64 {
        self.stat(name).parse().expect("a number")
    }
}

// The tests that decode run one at a time: each decodes with an OpenMP team of a thread per
// core (in this process or an example's), and two teams at once on two cores spun against
// each other: the file took 105-262 s where it takes 5-6 s one at a time.
use leap_tests::one_at_a_time as serial;

fn run(exe: &Path, mode: &str, max_tokens: u32, cancel_after: Option<u32>) -> Run {
    let mut cmd = Command::new(exe);
    cmd.arg(model_path(SMOLLM))
        .arg(mode)
        .arg(max_tokens.to_string())
        .env_remove("LEAP_LOG")
        .env_remove("GGML_BACKEND_PATH")
        // cargo's, naming the build tree: the example finds its libraries through rpaths.
        .env_remove("LD_LIBRARY_PATH");
    if let Some(n) = cancel_after {
        cmd.arg(n.to_string());
    }
    let out = cmd.output().expect("run leap_example");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "leap_example {mode} exited with {}:\n{stderr}",
        out.status
    );
    let stdout = String::from_utf8(out.stdout).expect("the callback gets UTF-8 only");
    Run {
        text: stdout
            .strip_suffix('\n')
            .expect("a newline after the text")
            .to_string(),
        stderr,
    }
}

#[test]
fn the_c_example_generates_through_libleap() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let exe = example(dir.path());

    let leap = run(&exe, "leap", 48, None);
    let plain = run(&exe, "plain", 48, None);
    eprintln!("leap:\n{}\n{}", leap.text, leap.stderr);
    eprintln!("plain: {}", plain.stderr);
    assert!(!leap.text.trim().is_empty(), "some text was generated");
    assert_eq!(
        leap.text, plain.text,
        "greedy Leap is plain decoding token for token"
    );
    assert_eq!(leap.number("tokens"), plain.number("tokens"));
    assert!(leap.number("tokens") <= 48);
    assert_eq!(
        leap.number("callbacks"),
        leap.number("tokens") - u64::from(leap.stat("finish") == "eog")
    );
    assert!(
        leap.number("target_calls") <= plain.number("target_calls"),
        "leap {} target calls, plain {}",
        leap.number("target_calls"),
        plain.number("target_calls")
    );
    // Two generations on one session, summed in its totals.
    let second: u64 = leap
        .stat("second:")
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("second: tokens N");
    assert!(second > 0);
    assert!(leap
        .stat("totals:")
        .starts_with(&format!("tokens {} ", leap.number("tokens") + second)));
    // The log went to the example's callback, none of it to stderr.
    let log = leap.stat("log:");
    let llama_lines: u64 = log
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("log: llama.cpp N leap M");
    assert!(
        llama_lines > 10,
        "the load's log reached the callback: {log}"
    );
    assert!(
        !leap.stderr.contains("llama.cpp: "),
        "no log line on stderr:\n{}",
        leap.stderr
    );
    assert!(leap.stat("tokenize:").ends_with("the text back"));
    let progress = leap.stat("progress:");
    assert!(progress.ends_with("calls, last 1.00"), "{progress}");
    let calls: u32 = progress.split_whitespace().next().unwrap().parse().unwrap();
    assert!(calls >= 2, "{progress}");
    // A stop string taken from a conversation's answer cuts the same answer there.
    let chat = leap.stat("chat:");
    assert!(chat.ends_with("finish stop, the text cut there"), "{chat}");
    // The error paths: a missing model, a prompt that is not UTF-8.
    let missing = leap.stat("missing model:");
    assert!(missing.starts_with("status 3 "), "{missing}");
    assert!(missing.contains("/nonexistent/model.gguf"), "{missing}");
    assert!(leap
        .stat("invalid prompt:")
        .starts_with("status 1: prompt is not valid UTF-8"));

    // A callback that returns false on the 5th token ends the generation there.
    let cancelled = run(&exe, "leap", 48, Some(5));
    assert_eq!(cancelled.stat("finish"), "cancelled");
    assert_eq!(cancelled.number("tokens"), 5);
    assert_eq!(cancelled.number("callbacks"), 5);
    assert!(
        leap.text.starts_with(&cancelled.text) && cancelled.text.len() < leap.text.len(),
        "{:?} is the start of {:?}",
        cancelled.text,
        leap.text
    );
}

/// The app's side of `make install`: scripts/install into a fresh prefix, the example built
/// with `pkg-config --cflags --libs leap` only, running on the installed libraries (none from
/// the build tree) with the build tree's text.
#[test]
fn an_app_builds_against_the_installed_tree_with_pkg_config() {
    let _serial = serial();
    libleap();
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("prefix");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let st = Command::new(format!("{root}/scripts/install"))
        .arg(&prefix)
        .env("LIB_DIR", profile_dir())
        .status()
        .expect("run scripts/install");
    assert!(st.success(), "scripts/install failed");
    let lib = prefix.join("lib");
    let abi = leap::leap_abi_version();
    assert_eq!(
        std::fs::read_link(lib.join("libleap.so")).unwrap(),
        PathBuf::from(format!("libleap.so.{abi}"))
    );
    let dynamic = |file: &Path| {
        let out = Command::new("readelf").arg("-d").arg(file).output();
        String::from_utf8_lossy(&out.expect("readelf").stdout).into_owned()
    };
    let d = dynamic(&lib.join(format!("libleap.so.{abi}")));
    assert!(
        d.contains(&format!("Library soname: [libleap.so.{abi}]")),
        "{d}"
    );
    assert!(d.contains("Library rpath: [$ORIGIN/leap]"), "{d}");

    let pc = lib.join("pkgconfig");
    let out = Command::new("pkg-config")
        .args(["--cflags", "--libs", "leap"])
        .env("PKG_CONFIG_PATH", &pc)
        .output()
        .expect("run pkg-config");
    assert!(
        out.status.success(),
        "pkg-config leap: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut flags: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(String::from)
        .collect();
    assert!(
        flags.contains(&format!("-I{}", prefix.join("include").display())),
        "{flags:?}"
    );
    // Where the loader finds libleap.so.N is the app's to say.
    flags.push(format!("-Wl,-rpath,{}", lib.display()));
    let exe = example_with(dir.path(), &flags);
    let ldd = Command::new("ldd")
        .arg(&exe)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("ldd");
    let ldd = String::from_utf8_lossy(&ldd.stdout).into_owned();
    let target = profile_dir();
    for l in ldd
        .lines()
        .filter(|l| l.contains("libleap") || l.contains("libllama") || l.contains("libggml"))
    {
        assert!(
            l.contains(&*prefix.to_string_lossy()) && !l.contains(&*target.to_string_lossy()),
            "{l}\n{ldd}"
        );
    }
    assert!(
        ldd.contains(&format!("libleap.so.{abi} => {}", lib.display())),
        "{ldd}"
    );

    let installed = run(&exe, "plain", 16, None);
    let built = run(&example(dir.path()), "plain", 16, None);
    assert_eq!(installed.text, built.text);
    assert_eq!(installed.stat("chat:"), built.stat("chat:"));
}

unsafe extern "C" fn stop_at_half(fraction: f32, user_data: *mut std::ffi::c_void) -> bool {
    // SAFETY: `user_data` is the test's Vec, alive across the load.
    unsafe { &mut *user_data.cast::<Vec<f32>>() }.push(fraction);
    fraction < 0.5
}

/// A progress callback sees the load rise and can stop it: LEAP_ERR_CANCELLED, no model.
#[test]
fn a_progress_callback_can_stop_the_load() {
    use leap::*;
    let path = std::ffi::CString::new(model_path(SMOLLM).to_str().unwrap()).unwrap();
    let mut seen: Vec<f32> = Vec::new();
    let params = leap_model_params {
        progress: Some(stop_at_half),
        progress_user_data: (&raw mut seen).cast(),
        ..leap_model_default_params()
    };
    let mut model = std::ptr::dangling_mut();
    // SAFETY: valid pointers; `seen` outlives the call.
    let st = unsafe { leap_model_open(path.as_ptr(), &params, &mut model) };
    assert_eq!(st, LEAP_ERR_CANCELLED, "{}", last_error());
    assert!(model.is_null());
    assert_eq!(
        last_error(),
        "the progress callback stopped loading the model"
    );
    assert!(
        seen.len() >= 2 && seen.windows(2).all(|w| w[0] <= w[1]),
        "{seen:?}"
    );
    assert!(*seen.last().unwrap() >= 0.5, "{seen:?}");
}

/// `leap_session_cancel` from another thread stops a generation in its prompt processing; the
/// session generates again afterwards.
#[test]
fn a_cancel_from_another_thread_stops_prompt_processing() {
    let _serial = serial();
    use leap::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    let path = std::ffi::CString::new(model_path(SMOLLM).to_str().unwrap()).unwrap();
    let params = leap_model_params {
        threads: leap_tests::threads(),
        ..leap_model_default_params()
    };
    let prompt = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/data/attention-notes.txt"
    ))
    .unwrap();
    let prompt = std::ffi::CString::new(prompt).unwrap();
    let mut model = std::ptr::null_mut();
    let mut session = std::ptr::null_mut();
    // SAFETY: valid pointers; the session outlives the canceller (joined before it is freed).
    unsafe {
        assert_eq!(leap_model_open(path.as_ptr(), &params, &mut model), LEAP_OK);
        assert_eq!(leap_session_new(model, &mut session), LEAP_OK);
        let done = AtomicBool::new(false);
        let addr = session as usize;
        let mut stats = leap_stats::default();
        let gp = leap_generate_params {
            max_tokens: 64,
            ..leap_generate_default_params()
        };
        let st = std::thread::scope(|s| {
            // Cancels until the generation returns: one lands after it starts (a cancel
            // before is forgotten), and the prompt of ~1500 tokens takes far longer.
            s.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    assert_eq!(leap_session_cancel(addr as *mut leap_session), LEAP_OK);
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
            });
            let st = leap_generate(
                session,
                prompt.as_ptr(),
                &gp,
                None,
                std::ptr::null_mut(),
                &mut stats,
            );
            done.store(true, Ordering::Relaxed);
            st
        });
        assert_eq!(st, LEAP_OK, "{}", last_error());
        assert_eq!(stats.finish, LEAP_FINISH_CANCELLED);
        assert_eq!(stats.tokens, 0, "stopped before the first token");
        assert!(stats.prompt_tokens > 1000);
        let short = leap_generate_params {
            max_tokens: 4,
            ..leap_generate_default_params()
        };
        let st = leap_generate(
            session,
            c"Hello".as_ptr(),
            &short,
            None,
            std::ptr::null_mut(),
            &mut stats,
        );
        assert_eq!(st, LEAP_OK, "{}", last_error());
        assert!(stats.tokens >= 1 && stats.finish != LEAP_FINISH_CANCELLED);
        leap_session_free(session);
        leap_model_free(model);
    }
}

#[test]
fn libleap_finds_llama_cpp() {
    let so = libleap();
    let out = Command::new("ldd").arg(&so).output().expect("run ldd");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("libllama"), "{text}");
    assert!(!text.contains("not found"), "{text}");
}

#[test]
fn the_header_is_cpp_too() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let status = Command::new(&cxx)
        .args(["-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-x", "c++"])
        .arg(format!("-I{}", include_dir()))
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../include/leap.h"))
        .status()
        .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
    assert!(status.success(), "include/leap.h does not compile as C++");
}

/// What a token callback that re-enters its own session saw.
struct Reentry {
    session: *mut leap::leap_session,
    generate: leap::leap_status,
    totals: leap::leap_status,
}

unsafe extern "C" fn reenter(
    _piece: *const std::ffi::c_char,
    _len: usize,
    _token: i32,
    user_data: *mut std::ffi::c_void,
) -> bool {
    // SAFETY: `user_data` is the test's `Reentry`, alive across the generation.
    let r = unsafe { &mut *user_data.cast::<Reentry>() };
    let mut stats = leap::leap_stats::default();
    // SAFETY: a live session and valid pointers: the calls must refuse, not alias.
    unsafe {
        r.generate = leap::leap_generate(
            r.session,
            c"again".as_ptr(),
            std::ptr::null(),
            None,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        r.totals = leap::leap_session_totals(r.session, &mut stats);
    }
    false
}

fn last_error() -> String {
    // SAFETY: leap_last_error returns a NUL-terminated string valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(leap::leap_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// The API called from Rust as C would call it: what an app can get wrong is an error with a
/// message, never undefined behaviour.
#[test]
fn misuse_is_an_error_not_undefined_behaviour() {
    let _serial = serial();
    use leap::*;

    let path = std::ffi::CString::new(model_path(SMOLLM).to_str().unwrap()).unwrap();
    let params = leap_model_params {
        n_ctx: 64,
        threads: leap_tests::threads(),
        ..leap_model_default_params()
    };
    let mut model = std::ptr::null_mut();
    let mut session = std::ptr::null_mut();
    // SAFETY: valid pointers throughout; every object is freed once, at the end.
    unsafe {
        assert_eq!(leap_model_open(path.as_ptr(), &params, &mut model), LEAP_OK);
        assert_eq!(leap_session_new(model, &mut session), LEAP_OK);
        // Freed first: the session keeps the model loaded.
        leap_model_free(model);

        // A request that does not fit the context (64 tokens, which llama.cpp may round up)
        // fails before any work.
        let long = leap_generate_params {
            max_tokens: 1000,
            ..leap_generate_default_params()
        };
        let mut stats = leap_stats::default();
        let st = leap_generate(
            session,
            c"Hello".as_ptr(),
            &long,
            None,
            std::ptr::null_mut(),
            &mut stats,
        );
        assert_eq!(st, LEAP_ERR_CONTEXT_FULL, "{}", last_error());
        assert!(
            last_error().contains("exceed the context of"),
            "{}",
            last_error()
        );

        // Sampling parameters out of range.
        let bad = leap_generate_params {
            temperature: 0.8,
            top_p: 2.0,
            ..leap_generate_default_params()
        };
        let st = leap_generate(
            session,
            c"Hello".as_ptr(),
            &bad,
            None,
            std::ptr::null_mut(),
            &mut stats,
        );
        assert_eq!(st, LEAP_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("top_p 2"), "{}", last_error());

        // A callback that calls back into its own session is refused, and its false stops.
        let mut r = Reentry {
            session,
            generate: LEAP_OK,
            totals: LEAP_OK,
        };
        let short = leap_generate_params {
            max_tokens: 8,
            chat: true,
            ..leap_generate_default_params()
        };
        let st = leap_generate(
            session,
            c"Hello".as_ptr(),
            &short,
            Some(reenter),
            (&raw mut r).cast(),
            &mut stats,
        );
        assert_eq!(st, LEAP_OK, "{}", last_error());
        assert_eq!(r.generate, LEAP_ERR_INVALID_ARGUMENT);
        assert_eq!(r.totals, LEAP_ERR_INVALID_ARGUMENT);
        assert_eq!((stats.tokens, stats.finish), (1, LEAP_FINISH_CANCELLED));

        // Sampled decoding on the same session, then its totals.
        let sampled = leap_generate_params {
            max_tokens: 8,
            temperature: 0.8,
            seed: 7,
            ..leap_generate_default_params()
        };
        let st = leap_generate(
            session,
            c"Once upon a time".as_ptr(),
            &sampled,
            None,
            std::ptr::null_mut(),
            &mut stats,
        );
        assert_eq!(st, LEAP_OK, "{}", last_error());
        assert!(stats.tokens >= 1 && stats.tokens <= 8);
        let mut totals = leap_stats::default();
        assert_eq!(leap_session_totals(session, &mut totals), LEAP_OK);
        assert_eq!(totals.tokens, 1 + stats.tokens);
        assert_eq!(totals.finish, stats.finish);
        leap_session_free(session);
    }
}

/// Two models opened in one process with different device settings each keep theirs: the one
/// opened last (kernels off) does not turn Leap's device off for the first, and the first's
/// does not reach the second. Both give the same greedy text (the device's rows are ggml's).
#[test]
fn two_models_with_different_device_settings_keep_their_own() {
    let _serial = serial();
    use leap::*;

    let path = std::ffi::CString::new(model_path(SMOLLM).to_str().unwrap()).unwrap();
    let open = |kernels: bool| {
        let params = leap_model_params {
            n_ctx: 512,
            threads: leap_tests::threads(),
            leap_kernels: kernels,
            ..leap_model_default_params()
        };
        let (mut model, mut session) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid pointers.
        unsafe {
            assert_eq!(leap_model_open(path.as_ptr(), &params, &mut model), LEAP_OK);
            assert_eq!(leap_session_new(model, &mut session), LEAP_OK);
        }
        (model, session)
    };
    unsafe extern "C" fn collect(
        piece: *const std::ffi::c_char,
        len: usize,
        _: i32,
        user_data: *mut std::ffi::c_void,
    ) -> bool {
        // SAFETY: `piece` holds `len` bytes; `user_data` is the caller's String.
        unsafe {
            let bytes = std::slice::from_raw_parts(piece.cast::<u8>(), len);
            (*user_data.cast::<String>()).push_str(&String::from_utf8_lossy(bytes));
        }
        true
    }
    let generate = |session: *mut leap_session| {
        let mut text = String::new();
        let mut stats = leap_stats::default();
        let gp = leap_generate_params {
            max_tokens: 24,
            ..leap_generate_default_params()
        };
        // SAFETY: a live session; `text` outlives the call.
        let st = unsafe {
            leap_generate(
                session,
                c"The three primary colours are".as_ptr(),
                &gp,
                Some(collect),
                (&raw mut text).cast(),
                &mut stats,
            )
        };
        assert_eq!(st, LEAP_OK, "{}", last_error());
        (text, stats)
    };
    let (on_model, on) = open(true);
    let (off_model, off) = open(false);
    let (text_on, stats_on) = generate(on);
    let (text_off, stats_off) = generate(off);
    assert_eq!(text_on, text_off, "the same greedy text either way");
    assert_eq!(
        stats_off.device_nodes, 0,
        "kernels off: llama.cpp's kernels alone"
    );
    let mut totals = leap_stats::default();
    // SAFETY: live sessions, writable out-pointer.
    unsafe {
        assert_eq!(leap_session_totals(off, &mut totals), LEAP_OK);
        assert_eq!(totals.device_nodes, 0);
        assert_eq!(leap_session_totals(on, &mut totals), LEAP_OK);
    }
    // The device computes SmolLM2's products wherever Leap has a checked Q4_1 kernel.
    if leap_host::qdot::checked(leap_host::qdot::Kind::Q4_1).is_some() {
        assert!(
            stats_on.device_nodes > 0,
            "the first model's sessions kept Leap's device after a model with it off was opened"
        );
        assert_eq!(totals.device_nodes, stats_on.device_nodes);
    }
    // SAFETY: each freed once.
    unsafe {
        leap_session_free(on);
        leap_session_free(off);
        leap_model_free(on_model);
        leap_model_free(off_model);
    }
}
