#!/usr/bin/env python3
"""Writes the GGUF seeds of fuzz/corpus/{sidecar,gguf}/: small files in the GGUF v3 layout
ggml's gguf code reads (what Leap's Sidecar::save and llama.cpp's converters write).
The other seeds (JSON request bodies, workload lines) are plain text: a few requests of the
kinds the server takes, and lines of ../shared/workloads/dev-all.jsonl with short prompts.

    python3 fuzz/seeds.py   # from the repository root
"""
import os
import struct

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_K, GGML_Q6_K = 0, 1, 2, 12, 14
# bytes per block and elements per block of the ggml types used here
TYPE_SIZE = {GGML_F32: (4, 1), GGML_F16: (2, 1), GGML_Q4_0: (18, 32), GGML_Q4_K: (144, 256),
             GGML_Q6_K: (210, 256)}
ALIGN = 32
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
          BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}


def string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def value(t, v):
    if t == STR:
        return string(v)
    if t == ARR:
        et, items = v
        out = struct.pack("<IQ", et, len(items))
        return out + b"".join(value(et, x) for x in items)
    return struct.pack(SCALAR[t], v)


def gguf(kv, tensors=()):
    """kv: [(key, type, value)]; tensors: [(name, ggml_type, ne)] (data filled with a ramp)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for k, t, v in kv:
        head += string(k) + struct.pack("<I", t) + value(t, v)
    data = b""
    for name, gt, ne in tensors:
        bsz, blk = TYPE_SIZE[gt]
        n = 1
        for x in ne:
            n *= x
        size = n // blk * bsz
        head += string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<q", x) for x in ne)
        head += struct.pack("<IQ", gt, len(data))
        data += bytes((i * 7) & 0x3F for i in range(size))
        data += b"\0" * (-len(data) % ALIGN)
    head += b"\0" * (-len(head) % ALIGN)
    return head + data


def write(path, blob):
    assert len(blob) < 64 * 1024, path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(blob)


def main():
    side = "fuzz/corpus/sidecar"
    version = [("leap.sidecar.version", U32, 1)]
    # `leap profile-heads`: per-head keep fractions of 2 layers x 2 heads.
    write(f"{side}/attn-profile.leap.gguf", gguf(version + [
        ("leap.attn.keep", ARR, (F32, [0.25, 0.5, 1.0, 0.125])),
        ("leap.attn.head_importance", ARR, (F32, [1.0, 2.0, 0.5, 0.25])),
        ("leap.attn.layer_importance", ARR, (F32, [1.0, 0.5])),
        ("leap.attn.n_layer", U32, 2),
        ("leap.attn.n_head", U32, 2),
        ("leap.attn.global_keep", F32, 0.5),
        ("leap.attn.corpus", STR, "dev-longtext.txt"),
        ("leap.attn.tokens", U32, 4096),
    ]))
    # `leap train-heads`: an early-exit head at layer 2 of 4, 4-wide hidden states.
    write(f"{side}/exit-head.leap.gguf", gguf(version + [
        ("leap.exit.layer", U32, 2),
        ("leap.exit.n_embd", U32, 4),
        ("leap.exit.n_layer", U32, 4),
        ("leap.exit.a", ARR, (F32, [float(i == j) for i in range(4) for j in range(4)])),
        ("leap.exit.temperature", F32, 1.5),
        ("leap.exit.shadow", ARR, (I32, [2, 17, 262143])),
        ("leap.exit.model", STR, "q6_K:640x262144:1f2e3d4c5b6a7988"),
        ("leap.exit.corpus", STR, "dev-all.jsonl"),
    ]))
    # Both, and keys of other tools of every type (kept or skipped).
    write(f"{side}/mixed.leap.gguf", gguf(version + [
        ("general.name", STR, "sidecar"),
        ("other.u8", U8, 7), ("other.i16", I16, -3), ("other.u64", U64, 1 << 40),
        ("other.f64", F64, 0.125), ("other.bool", BOOL, True),
        ("other.strs", ARR, (STR, ["a", "bc"])), ("other.empty", ARR, (F32, [])),
        ("leap.attn.keep", ARR, (F32, [0.5, 0.5])),
        ("leap.attn.n_layer", U32, 1), ("leap.attn.n_head", U32, 2),
        ("leap.exit.layer", U32, 0), ("leap.exit.n_embd", U32, 1), ("leap.exit.n_layer", U32, 2),
        ("leap.exit.a", ARR, (F32, [1.0])), ("leap.exit.temperature", F32, 1.0),
        ("leap.exit.model", STR, ""),
    ]))
    write(f"{side}/empty.leap.gguf", gguf([]))
    # Inputs that crashed a target once, kept as seeds (with a unit test each in the crate
    # that was fixed); crash-*.leap.gguf are the fuzzer's own finds, kept as it wrote them.
    write(f"{side}/crash-exit-layer-max.leap.gguf", gguf(version + [
        ("leap.exit.layer", U32, 0xFFFFFFFF), ("leap.exit.n_embd", U32, 1),
        ("leap.exit.n_layer", U32, 2), ("leap.exit.a", ARR, (F32, [1.0])),
        ("leap.exit.temperature", F32, 1.0), ("leap.exit.model", STR, "m"),
    ]))
    write(f"{side}/crash-attn-no-heads.leap.gguf", gguf(version + [
        ("leap.attn.keep", ARR, (F32, [])), ("leap.attn.n_layer", U32, 18),
        ("leap.attn.n_head", U32, 0),
    ]))

    model = "fuzz/corpus/gguf"
    arch = [("general.architecture", STR, "gemma3"), ("general.name", STR, "tiny"),
            ("gemma3.block_count", U32, 2), ("gemma3.embedding_length", U32, 256),
            ("general.alignment", U32, ALIGN),
            ("tokenizer.ggml.tokens", ARR, (STR, ["<pad>", "<bos>", "a", "b"]))]
    block = lambda i: [(f"blk.{i}.attn_norm.weight", GGML_F32, [256]),
                       (f"blk.{i}.attn_q.weight", GGML_Q4_K, [256, 2]),
                       (f"blk.{i}.ffn_down.weight", GGML_Q6_K, [256, 2])]
    # Gemma-like: tied output (no output.weight).
    write(f"{model}/tied.gguf", gguf(arch, [("token_embd.weight", GGML_Q4_0, [256, 4])]
                                     + block(0) + block(1)
                                     + [("output_norm.weight", GGML_F32, [256])]))
    # SmolLM-like: its own output projection.
    write(f"{model}/untied.gguf", gguf(
        [("general.architecture", STR, "llama"), ("llama.block_count", U32, 1)],
        [("token_embd.weight", GGML_F16, [64, 4]), ("blk.0.attn_q.weight", GGML_Q4_0, [64, 2]),
         ("output.weight", GGML_F16, [64, 4])]))
    write(f"{model}/no-tensors.gguf", gguf(arch))


if __name__ == "__main__":
    main()
