#!/usr/bin/env python3
"""Writes the GGUF seeds of the sidecar and gguf fuzz targets into DIR/{sidecar,gguf}/
(default fuzz/work, where scripts/fuzz runs them): small files in the GGUF v3 layout ggml's
gguf code reads (what Leap's Sidecar::save and llama.cpp's converters write). They are made
here, not kept in git, which holds no GGUF files. The other seeds (JSON request bodies,
workload lines, chat bodies) are plain text in fuzz/corpus/: a few requests of the kinds the
server takes, and lines of ../shared/workloads/dev-all.jsonl with short prompts.

    python3 fuzz/seeds.py [DIR]   # from the repository root
"""
import os
import struct
import sys

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


# Inputs the fuzzer found that crashed `sidecar` (a key with a NUL byte in its name; a key that
# is not UTF-8), byte for byte as it wrote them; unit tests in host/src/sidecar.rs cover both.
CRASH_NUL_KEY = bytes.fromhex(
    "47475546030000000000000000000000090000000000000014000000000000006c6561702e73696465636172"
    "2e76657273696f6e04000000010000000f000000000000006c6561702e657869742e6c617965720400000002"
    "00000010000000000000006c6561702e657869742e6e5f656d6264040000000400000011000000000000006c"
    "6561702e657869742e6e5f6c6179657204000000040000000b000000000000006c6561702e657869742e6109"
    "0000000600000010000000000000000000803f000000000000000000000000000000000000803f0000000000"
    "00000000000000000000000000803f000000000000000000000000000000000000803f150000000000000000"
    "0061702e657869742e74656d7065726174757265060000000000c03f10000000000000006c6561702e657869"
    "742e736861646f77090000000500000003000000000000000200000011000000ffff03000f00000000000000"
    "6c6561702e657869742e6d6f64656c08000000200000000000000071365f4b3a363430783236323134343a31"
    "66326533643463356236613739383810000000000000006c6561702e657869742e636f72707573080000000d"
    "000000000000006465762d616c6c2e6a736f6e6c0000000000000000000000000000000000000000")
CRASH_UTF8_KEY = bytes.fromhex(
    "47475546030000000000000000000000090000000000000014000000000000006c6561702e73696465636172"
    "2e76657273696f6e04000000010000000f000000000000006c6561702e657869742e6c617965720400000002"
    "00000010000000000000006c6561702e657869742f6e5f656d3864040000000400000011000000000000006c"
    "6561702e657869742e6e5f6c6179657204000000040000000b000000000000006c6561702e657869742e6109"
    "00000006000000100000000000000000000000000000010000000000000000000000000000000000003f0000"
    "003f11000000000000006c6561702e6174746e2e6e5f6c61796572040000000100000010000000000000006c"
    "6561702e6174746e2e6e5f6865616404000000020000000f000000000000006c65617087657869742e6c6179"
    "657204000000feff00bd10000000000000006c6561702e657869742e6e5f656d626404000000010000001100"
    "0000000000006c656170efbfbd657869742e6c6179657204000000026c6561702e66757a7a2e746f7563682d"
    "657869742e610900000006000001000073000000000000008c000000")


def main(root):
    side = f"{root}/sidecar"
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
    # that was fixed).
    write(f"{side}/crash-exit-layer-max.leap.gguf", gguf(version + [
        ("leap.exit.layer", U32, 0xFFFFFFFF), ("leap.exit.n_embd", U32, 1),
        ("leap.exit.n_layer", U32, 2), ("leap.exit.a", ARR, (F32, [1.0])),
        ("leap.exit.temperature", F32, 1.0), ("leap.exit.model", STR, "m"),
    ]))
    write(f"{side}/crash-attn-no-heads.leap.gguf", gguf(version + [
        ("leap.attn.keep", ARR, (F32, [])), ("leap.attn.n_layer", U32, 18),
        ("leap.attn.n_head", U32, 0),
    ]))

    write(f"{side}/crash-nul-key.leap.gguf", CRASH_NUL_KEY)
    write(f"{side}/crash-utf8-key.leap.gguf", CRASH_UTF8_KEY)

    model = f"{root}/gguf"
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
    main(sys.argv[1] if len(sys.argv) > 1 else "fuzz/work")
