#!/usr/bin/env python3
"""Writes a small random-weight GGUF model of one llama.cpp architecture, for tests.

    python3 tests/models/random_gguf.py --arch qwen2 --type Q4_0 \
        --tokenizer-from SmolLM2-135M-Instruct.Q4_1.gguf --out qwen2-q4_0.gguf

The tokenizer (every `tokenizer.*` key: BPE vocabulary, merges, special tokens, chat template)
is copied from another GGUF, SmolLM2's in the tests (49152 tokens), so prompts tokenize as
real text. The weights are random (normal, seeded from `--seed` and the architecture: the same
seed gives the same float weights in every type, quantized differently), which gives nearly
tied logits: exactly where a row whose result depends on its batch would flip a greedy token.

Architectures (tensor names and hyperparameters as llama.cpp's `src/models/ARCH.cpp` loads
them; every matrix dimension a multiple of 32, as the block types need):

- `llama`: grouped-query attention, head size 32, an output matrix of its own.
- `qwen2`: q/k/v biases, tied output.
- `qwen3`: per-head q/k RMS norms, a head size (`key_length`) that makes q wider than the
  hidden state, tied output.
- `phi3`: fused `attn_qkv`, fused gate+up in `ffn_up`, an output matrix of its own.
- `gemma2`: sliding-window attention on every other layer (`--window`, default 32 cells, so a
  128-token generation crosses it), attention and final logit soft-capping, post-norms, GELU.
- `mamba`: selective state-space layers, recurrent state and no attention.
- `lfm2`: a hybrid: gated short convolutions (recurrent state) and attention layers.

The embedding (49152 x hidden) is most of the file: 1.5 to 12 MB a model by type.
Needs the `gguf` package (PyPI; its `gguf.quants` quantizes Q4_0..Q8_0 in numpy).
"""

import argparse
import sys
import zlib

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType as F

TYPES = {
    "Q4_0": (Q.Q4_0, F.MOSTLY_Q4_0),
    "Q4_1": (Q.Q4_1, F.MOSTLY_Q4_1),
    "Q5_0": (Q.Q5_0, F.MOSTLY_Q5_0),
    "Q5_1": (Q.Q5_1, F.MOSTLY_Q5_1),
    "Q8_0": (Q.Q8_0, F.MOSTLY_Q8_0),
    "F16": (Q.F16, F.MOSTLY_F16),
}

# Shapes per architecture: hidden size, layers, heads, kv heads, head size, feed-forward size.
# About 1.5 to 12 MB a model by type, most of it the 49152 x hidden embedding.
ARCHS = {
    "llama": dict(n_embd=128, n_layer=2, n_head=4, n_head_kv=2, head=32, n_ff=256),
    "qwen2": dict(n_embd=128, n_layer=2, n_head=2, n_head_kv=1, head=64, n_ff=192),
    "qwen3": dict(n_embd=96, n_layer=2, n_head=2, n_head_kv=1, head=64, n_ff=160),
    "phi3": dict(n_embd=128, n_layer=2, n_head=4, n_head_kv=4, head=32, n_ff=224),
    "gemma2": dict(n_embd=128, n_layer=4, n_head=2, n_head_kv=1, head=64, n_ff=256),
    # Hidden size, layers, state size, convolution width, time-step rank (inner size 2x hidden).
    "mamba": dict(n_embd=128, n_layer=2, d_state=16, d_conv=4, dt_rank=32),
    # Short convolutions (recurrent state) on the layers without kv heads, attention between.
    "lfm2": dict(n_embd=128, n_layer=3, n_head=2, n_head_kv=[0, 1, 0], head=64, n_ff=256,
                 l_cache=3),
}

# How much an output matrix of its own (llama, phi3) follows the embedding (correlation).
OUTPUT_TIE = 0.8


class Builder:
    """Random tensors in one type, written through a `gguf.GGUFWriter`."""

    def __init__(self, writer, qtype, rng):
        self.w = writer
        self.qtype = qtype
        self.rng = rng

    def matrix(self, name, rows, cols, std=None, qtype=None):
        """A random weight matrix of `rows` outputs over `cols` inputs (ggml's ne = [cols,
        rows]), of standard deviation `std` (by default cols**-0.5, which keeps a product's
        outputs at its inputs' scale), written in the model's type (or `qtype`); returns its
        float values."""
        if std is None:
            std = cols**-0.5
        x = self.rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        self.write(name, x, qtype)
        return x

    def write(self, name, x, qtype=None):
        """The float matrix `x`, in the model's type (or `qtype`)."""
        qtype = self.qtype if qtype is None else qtype
        self.w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    def vector(self, name, n, mean=0.0, std=0.0):
        """A 1-D tensor (norm weights, biases): always F32, as llama.cpp's converters keep them."""
        x = np.float32(mean) + self.rng.standard_normal(n, dtype=np.float32) * np.float32(std)
        self.w.add_tensor(name, x)


def read_tokenizer(path):
    """Every `tokenizer.*` key of the GGUF at `path` as (key, value, type, element type), to
    pass to `write` (reading SmolLM2's 49152 tokens and 48900 merges takes a few seconds: read
    once for many models)."""
    r = gguf.GGUFReader(path)
    kvs = []
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(f.parts[i]) for i in f.data]
            else:
                val = [f.parts[i].tolist()[0] for i in f.data]
            kvs.append((key, val, vtype, sub))
        elif vtype == gguf.GGUFValueType.STRING:
            kvs.append((key, bytes(f.parts[f.data[0]]), vtype, None))
        else:
            kvs.append((key, f.parts[f.data[0]].tolist()[0], vtype, None))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in kvs):
        sys.exit(f"{path}: no tokenizer.ggml.tokens (a GGUF with a tokenizer is needed)")
    return kvs


def write(arch, type_name, tokenizer, out, seed=0, window=32):
    """Write the model to `out`; `tokenizer` is what `read_tokenizer` returned."""
    if arch not in ARCHS:
        sys.exit(f"--arch {arch}: one of {', '.join(ARCHS)}")
    if type_name not in TYPES:
        sys.exit(f"--type {type_name}: one of {', '.join(TYPES)}")
    qtype, ftype = TYPES[type_name]
    s = ARCHS[arch]

    w = gguf.GGUFWriter(out, arch)
    # Not the architecture's name: llama.cpp special-cases some tokenizers by model name
    # ("phi3" expects Phi-3's own special tokens).
    w.add_name(f"random weights {type_name} seed {seed}")
    for key, val, vtype, sub in tokenizer:
        w.add_key_value(key, val, vtype, sub_type=sub)
    n_vocab = next(len(v) for k, v, *_ in tokenizer if k == "tokenizer.ggml.tokens")
    w.add_vocab_size(n_vocab)
    w.add_file_type(ftype)
    w.add_context_length(4096)
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["n_layer"])
    w.add_layer_norm_rms_eps(1e-6)

    # One generator per (seed, arch): the float weights do not depend on the type.
    b = Builder(w, qtype, np.random.default_rng([seed, zlib.crc32(arch.encode())]))
    n_embd = s["n_embd"]
    # Embedding rows of norm ~1.5: after the final norm (rms 1) logits have a std of ~1.5,
    # spread enough that output varies with context, close enough that ties are near. Gemma
    # scales the embedding by sqrt(hidden) on input: smaller rows there, or with the tied
    # output every token would predict itself.
    embd_norm = 0.15 if arch == "gemma2" else 1.5
    embd = b.matrix("token_embd.weight", n_vocab, n_embd, embd_norm / np.sqrt(n_embd))
    # LFM2's final norm has the name of an embedding norm (llama.cpp: "fix for wrong name").
    b.vector("token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight", n_embd, 1.0, 0.1)
    if arch in ("llama", "phi3"):
        # An output matrix of its own, correlated with the embedding as a tied one is: a
        # token's own row then scores high after it, so the output falls into the loops that
        # retrieval drafts from (independent rows give text that never repeats).
        noise = b.rng.standard_normal(embd.shape, dtype=np.float32) * np.float32(embd.std())
        tie = np.float32(OUTPUT_TIE)
        b.write("output.weight", tie * embd + np.sqrt(1 - tie * tie) * noise)
    if arch == "mamba":
        mamba_layers(w, b, s)
    elif arch == "lfm2":
        lfm2_layers(w, b, s)
    else:
        attention_layers(w, b, arch, s, window)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def attention_layers(w, b, arch, s, window):
    """The transformer blocks of llama, qwen2, qwen3, phi3 and gemma2."""
    n_embd, n_layer, n_ff = s["n_embd"], s["n_layer"], s["n_ff"]
    n_head, n_head_kv, head = s["n_head"], s["n_head_kv"], s["head"]
    n_q, n_kv = n_head * head, n_head_kv * head
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma2":
        w.add_sliding_window(window)
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)

    for i in range(n_layer):
        p = f"blk.{i}."
        b.vector(p + "attn_norm.weight", n_embd, 1.0, 0.1)
        if arch == "phi3":
            b.matrix(p + "attn_qkv.weight", n_q + 2 * n_kv, n_embd)
        else:
            b.matrix(p + "attn_q.weight", n_q, n_embd)
            b.matrix(p + "attn_k.weight", n_kv, n_embd)
            b.matrix(p + "attn_v.weight", n_kv, n_embd)
        if arch == "qwen2":
            b.vector(p + "attn_q.bias", n_q, 0.0, 0.2)
            b.vector(p + "attn_k.bias", n_kv, 0.0, 0.2)
            b.vector(p + "attn_v.bias", n_kv, 0.0, 0.2)
        if arch == "qwen3":
            b.vector(p + "attn_q_norm.weight", head, 1.0, 0.1)
            b.vector(p + "attn_k_norm.weight", head, 1.0, 0.1)
        b.matrix(p + "attn_output.weight", n_embd, n_q)
        # Gemma's post-norms: larger than 1, so the blocks outweigh the (scaled) embedding.
        if arch == "gemma2":
            b.vector(p + "post_attention_norm.weight", n_embd, 4.0, 0.2)
        b.vector(p + "ffn_norm.weight", n_embd, 1.0, 0.1)
        if arch == "phi3":
            b.matrix(p + "ffn_up.weight", 2 * n_ff, n_embd)
        else:
            b.matrix(p + "ffn_gate.weight", n_ff, n_embd)
            b.matrix(p + "ffn_up.weight", n_ff, n_embd)
        b.matrix(p + "ffn_down.weight", n_embd, n_ff)
        if arch == "gemma2":
            b.vector(p + "post_ffw_norm.weight", n_embd, 4.0, 0.2)


def lfm2_layers(w, b, s):
    """LFM2's blocks (llama.cpp's `src/models/lfm2.cpp`): a hybrid, gated short convolutions
    (recurrent state) where a layer has no kv heads, attention with q/k norms elsewhere, a
    SwiGLU feed-forward unit in every layer."""
    n_embd, n_ff, head, l_cache = s["n_embd"], s["n_ff"], s["head"], s["l_cache"]
    w.add_feed_forward_length(n_ff)
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(10000.0)
    w.add_uint32(f"{w.arch}.shortconv.l_cache", l_cache)
    for i, n_kv_heads in enumerate(s["n_head_kv"]):
        p = f"blk.{i}."
        b.vector(p + "attn_norm.weight", n_embd, 1.0, 0.1)
        if n_kv_heads == 0:
            # l_cache (3) wide: F32, as llama.cpp keeps it.
            b.matrix(p + "shortconv.conv.weight", n_embd, l_cache, qtype=Q.F32)
            b.matrix(p + "shortconv.in_proj.weight", 3 * n_embd, n_embd)
            b.matrix(p + "shortconv.out_proj.weight", n_embd, n_embd)
        else:
            b.vector(p + "attn_q_norm.weight", head, 1.0, 0.1)
            b.vector(p + "attn_k_norm.weight", head, 1.0, 0.1)
            b.matrix(p + "attn_q.weight", n_embd, n_embd)
            b.matrix(p + "attn_k.weight", n_kv_heads * head, n_embd)
            b.matrix(p + "attn_v.weight", n_kv_heads * head, n_embd)
            b.matrix(p + "attn_output.weight", n_embd, n_embd)
        b.vector(p + "ffn_norm.weight", n_embd, 1.0, 0.1)
        b.matrix(p + "ffn_gate.weight", n_ff, n_embd)
        b.matrix(p + "ffn_up.weight", n_ff, n_embd)
        b.matrix(p + "ffn_down.weight", n_embd, n_ff)


def mamba_layers(w, b, s):
    """Mamba's selective state-space blocks (llama.cpp's `src/models/mamba.cpp`): recurrent
    memory, which cannot drop the last cells of a sequence as a KV cache can."""
    n_embd, n_layer = s["n_embd"], s["n_layer"]
    d_inner, d_state, d_conv, dt_rank = 2 * n_embd, s["d_state"], s["d_conv"], s["dt_rank"]
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.vector(p + "attn_norm.weight", n_embd, 1.0, 0.1)
        b.matrix(p + "ssm_in.weight", 2 * d_inner, n_embd)
        # d_conv (4) wide: not a block type's multiple of 32, F32 as llama.cpp keeps it.
        b.matrix(p + "ssm_conv1d.weight", d_inner, d_conv, qtype=Q.F32)
        b.vector(p + "ssm_conv1d.bias", d_inner, 0.0, 0.1)
        b.matrix(p + "ssm_x.weight", dt_rank + 2 * d_state, d_inner)
        b.matrix(p + "ssm_dt.weight", d_inner, dt_rank)
        # dt = softplus(x + bias) in [0.001, 0.1], as Mamba initialises it.
        dt = np.exp(b.rng.uniform(np.log(1e-3), np.log(1e-1), d_inner)).astype(np.float32)
        w.add_tensor(p + "ssm_dt.bias", (dt + np.log(-np.expm1(-dt))).astype(np.float32))
        # A = -exp(A_log) with A_log = log(1..d_state), stored as A.
        a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
        w.add_tensor(p + "ssm_a", a)
        w.add_tensor(p + "ssm_d", np.ones(d_inner, dtype=np.float32))
        b.matrix(p + "ssm_out.weight", n_embd, d_inner)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", required=True, choices=sorted(ARCHS))
    ap.add_argument("--type", required=True, choices=list(TYPES))
    ap.add_argument("--tokenizer-from", required=True, help="a GGUF whose tokenizer.* keys to copy")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=int, default=32, help="gemma2's sliding window, in cells")
    a = ap.parse_args()
    write(a.arch, a.type, read_tokenizer(a.tokenizer_from), a.out, a.seed, a.window)


if __name__ == "__main__":
    main()
