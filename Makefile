# Leap: the two commands are `make run` and `make test`; both set up what is missing first.
CARGO  ?= cargo
LEAP   := target/release/leap
PROMPT ?= The three most useful things to know about running language models on a phone are

.PHONY: all setup build models run test bench fmt clippy clean

all: build

setup:
	@scripts/setup

build: setup
	$(CARGO) build --release --workspace --bins

models: build
	@$(LEAP) models fetch >/dev/null

run: models
	$(LEAP) generate --prompt "$(PROMPT)" -n 96

test: models
	$(CARGO) test --release --workspace

# Plain decoding, llama.cpp's n-gram modes and Leap's engine on the dev workload.
bench: models
	$(LEAP) bench --model gemma3-270m --workload ../shared/workloads/dev-all.jsonl --limit 24 \
	  --modes plain,llama:ngram-simple,llama:ngram-mod,leap,leap:no-history,leap:tree --out bench.json

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy --release --workspace --all-targets

clean:
	$(CARGO) clean
