# Leap: the two commands are `make run` and `make test`; both set up what is missing first.
CARGO  ?= cargo
LEAP   := target/release/leap
PROMPT ?= The three most useful things to know about running language models on a phone are

.PHONY: all setup build plugin models run test bench fmt clippy clean

all: build

setup:
	@scripts/setup

# The CLI, and the plugin an unmodified llama.cpp loads (target/release/libggml_leap.so).
build: setup
	$(CARGO) build --release --workspace

plugin: setup
	$(CARGO) build --release -p leap-plugin
	@$(CARGO) run --release -q --bin leap -- plugin-path

models: build
	@$(LEAP) models fetch >/dev/null

run: models
	$(LEAP) generate --prompt "$(PROMPT)" -n 96

# tests/server also drives a stock llama-server (scripts/stock-llama builds it once, ~11 minutes,
# cached in ~/.cache/leap) with Leap's plugin.
test: models build
	$(CARGO) test --release --workspace
	LEAP_STOCK_BIN="$$(scripts/stock-llama)" LEAP=$(abspath $(LEAP)) python3 -m pytest -q tests/server

# The ablation: plain decoding, llama.cpp's n-gram modes and Leap's engine one technique at a
# time, on the dev workload (about 20 minutes on 2 cores).
bench: models
	$(LEAP) bench --model gemma3-270m --workload ../shared/workloads/dev-all.jsonl --limit 12 \
	  --modes plain,llama:ngram-mod,llama:ngram-simple,llama:ngram-map-k,leap:sam,leap:history,leap:reuse,leap:calib,leap:tree,leap:eager,leap \
	  --out bench.json

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy --release --workspace --all-targets

clean:
	$(CARGO) clean
