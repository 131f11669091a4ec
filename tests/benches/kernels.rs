//! Leap's kernels, one thread, caches warm (criterion):
//!
//! - `qdot/KIND/VARIANT/ROWS`: the multi-row quantized dot products of every type the device
//!   takes, each kernel variant this CPU runs, over 1024 weight rows of 2048 against 1 to 8
//!   activation rows; `qdot/KIND/ggml/1`: ggml's own one-row `vec_dot` over the same rows.
//! - `stream/Q8_0/VARIANT/ROWS`: one thread's half of Gemma 3's 262144 x 640 `Q8_0` output
//!   projection (89 MB, far past the caches), in tiles of 256 weight rows as the projection
//!   runs them: the weights come from DRAM, which is what the kernels' prefetch
//!   (`leap_kernels::qdot`'s `AHEAD`) is for.
//! - `kq/SHAPE/ROWS`: attention's f16 products in Gemma 3 270M's and SmolLM2-135M's shapes
//!   over 1024 cache cells, each kernel this CPU runs (`lanes`: the query-lanes kernel, for
//!   64-value rows, its query rows laid out beforehand as the device does once per node), and
//!   ggml's `vec_dot_f16` pair by pair (`lanesI`: the query-lanes kernels, AVX-512's first).
//! - `lone/SHAPE/ARITH/ROWS`: flash attention's softmax-weighted values for query rows computed
//!   each as ggml's lone row (`leap_kernels::lone::rows`, from scores given) over 1024 cells in
//!   two chunks, Gemma 3 270M's 4 query heads of 256 values and SmolLM2-135M's 3 of 64 per
//!   key-value head, 1 or 8 rows: `f32` the arithmetic of most builds, `half` a ggml built
//!   for AVX512-FP16's (where the CPU has it).
//!
//! - `softmax/EXP/ROWS`: attention's softmax rows (`leap_kernels::softmax::row`) with each
//!   exponential this CPU runs, SmolLM2-135M's 9 query heads a token over 1024 cells under an
//!   f16 causal mask (the last 24 cells hidden), 1 or 8 tokens' rows.
//!
//! `cargo bench -p leap-tests --bench kernels [-- FILTER]`. Times vary with the machine: read
//! them as ratios within one run.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use leap_backend::ffi as g;
use leap_host::qdot::{ggml_vec_dot, Kernel, Kind};
use leap_kernels::kq;

/// Weight rows and their length (values).
const ROWS_W: usize = 1024;
const N: usize = 2048;

/// `blocks` blocks of `len` bytes of patterned quants whose scales are small (an f16 of
/// ~0.008 where the scale is an f16, 0.01 where it is an f32), so that sums stay finite.
fn patterned(
    blocks: usize,
    len: usize,
    (x, y, m): (usize, usize, usize),
    scales: Scales,
) -> Vec<u8> {
    let mut v = vec![0u8; blocks * len];
    for (i, b) in v.chunks_exact_mut(len).enumerate() {
        for (j, q) in b.iter_mut().enumerate() {
            *q = ((i * x + j * y) % m) as u8;
        }
        match scales {
            Scales::F16At(at) => {
                for &a in at {
                    b[a..a + 2].copy_from_slice(&[0x1f, 0x20]);
                }
            }
            Scales::F32First => b[..4].copy_from_slice(&0.01f32.to_le_bytes()),
        }
    }
    v
}

#[derive(Clone, Copy)]
enum Scales {
    /// f16 scales at these byte offsets of a block.
    F16At(&'static [usize]),
    /// An f32 scale first (`Q8_K`).
    F32First,
}

/// Weights of `kind` and one activation row of its activation type.
fn operands(kind: Kind) -> (Vec<u8>, Vec<u8>) {
    let nb = N / kind.block_len();
    let (ws, acts) = match kind {
        Kind::Q4_1 => (Scales::F16At(&[0, 2]), Scales::F16At(&[0, 2])),
        Kind::Q8_0 | Kind::Q5_0 => (Scales::F16At(&[0]), Scales::F16At(&[0])),
        Kind::Q4K => (Scales::F16At(&[0, 2]), Scales::F32First),
        Kind::Q6K => (Scales::F16At(&[208]), Scales::F32First),
    };
    let w = patterned(ROWS_W * nb, kind.weight_block(), (31, 7, 251), ws);
    let a = patterned(nb, kind.act_block(), (13, 5, 200), acts);
    (w, a)
}

fn qdot(c: &mut Criterion) {
    // SAFETY: idempotent init (the traits table needs it).
    unsafe { g::ggml_cpu_init() };
    for kind in [Kind::Q8_0, Kind::Q5_0, Kind::Q4_1, Kind::Q4K, Kind::Q6K] {
        let Some(k0) = Kernel::new(kind) else {
            eprintln!("no {kind:?} kernel on this CPU");
            continue;
        };
        let (w, a) = operands(kind);
        let tile = 64 * kind.weight_block() * (N / kind.block_len());
        let mut g = c.benchmark_group(format!("qdot/{kind:?}"));
        let mut seen = Vec::new();
        let variants = [
            k0,
            k0.with_zmm(),
            k0.without_zmm(),
            k0.without_vnni(),
            k0.without_i8mm(),
            k0.without_dotprod(),
        ];
        for k in variants {
            if seen.contains(&k.variant()) {
                continue;
            }
            seen.push(k.variant());
            for rows in [1usize, 2, 4, 8, 16] {
                let acts_v: Vec<&[u8]> = (0..rows).map(|_| a.as_slice()).collect();
                let acts = k.prepare(N, &acts_v);
                let mut out = vec![0f32; 64 * rows];
                g.bench_with_input(BenchmarkId::new(k.variant(), rows), &rows, |b, _| {
                    b.iter(|| {
                        for t in w.chunks(tile) {
                            k.dot_many(&acts, t, &mut out);
                        }
                    })
                });
            }
        }
        let vec_dot = ggml_vec_dot(kind).expect("ggml has a vec_dot for it");
        let row = w.len() / ROWS_W;
        g.bench_function(BenchmarkId::new("ggml", 1), |b| {
            b.iter(|| {
                let mut s = 0f32;
                for r in w.chunks_exact(row) {
                    s = vec_dot(N, r, &a);
                }
                s
            })
        });
        g.finish();
    }
}

/// The `stream/` group (see the top of the file).
fn stream(c: &mut Criterion) {
    let Some(k0) = Kernel::new(Kind::Q8_0) else {
        eprintln!("no Q8_0 kernel on this CPU");
        return;
    };
    let (n, rows_w) = (640usize, 262144usize / 2);
    let row = n / 32 * Kind::Q8_0.weight_block();
    let w = patterned(
        rows_w * n / 32,
        Kind::Q8_0.weight_block(),
        (31, 7, 251),
        Scales::F16At(&[0]),
    );
    let a = patterned(
        n / 32,
        Kind::Q8_0.act_block(),
        (13, 5, 200),
        Scales::F16At(&[0]),
    );
    let mut g = c.benchmark_group("stream/Q8_0");
    g.sample_size(10);
    let mut seen = Vec::new();
    for k in [k0.with_zmm(), k0.without_zmm(), k0.without_vnni()] {
        if seen.contains(&k.variant()) {
            continue;
        }
        seen.push(k.variant());
        for rows in [1usize, 2, 4, 8] {
            let acts_v: Vec<&[u8]> = (0..rows).map(|_| a.as_slice()).collect();
            let acts = k.prepare(n, &acts_v);
            let mut out = vec![0f32; 256 * rows];
            g.bench_with_input(BenchmarkId::new(k.variant(), rows), &rows, |b, _| {
                b.iter(|| {
                    for t in w.chunks(256 * row) {
                        k.dot_many(&acts, t, &mut out[..t.len() / row * rows]);
                    }
                })
            });
        }
    }
    g.finish();
}

fn attention(c: &mut Criterion) {
    if !kq::cpu_ok() {
        eprintln!("the CPU does not run Leap's f16 attention kernels");
        return;
    }
    // SAFETY: idempotent init; the static traits table.
    let tr = unsafe {
        g::ggml_cpu_init();
        &*g::ggml_get_type_traits_cpu(g::GGML_TYPE_F16)
    };
    let vec_dot = tr.vec_dot.expect("f16 vec_dot");
    // (name, values a row, cache rows, bytes between rows, query rows per head group)
    for (name, n, rows, stride, per_row) in [
        ("gemma-kq", 256usize, 1024usize, 512usize, 4usize),
        ("gemma-kqv", 1024, 256, 4096, 4),
        ("smollm-kq", 64, 1024, 384, 3),
        ("smollm-kqv", 1024, 64, 4096, 3),
    ] {
        let mut g = c.benchmark_group(format!("kq/{name}"));
        let x: Vec<u8> = (0..rows * stride).map(|i| (i % 7) as u8 * 9).collect();
        for q_rows in [1usize, 2, 8] {
            let m = per_row * q_rows;
            let qs: Vec<f32> = (0..m * n).map(|i| (i % 13) as f32 * 0.01).collect();
            let qh: Vec<u16> = qs.iter().map(|&v| leap_kernels::f16::from_f32(v)).collect();
            let mut sums = vec![0f32; rows * m];
            for (i, &dots) in kq::kernels().iter().enumerate() {
                g.bench_with_input(
                    BenchmarkId::new(format!("leap{i}"), q_rows),
                    &q_rows,
                    |b, _| {
                        // SAFETY: the CPU runs the kernels; rows of n f16 inside x (stride >= 2n).
                        b.iter(|| unsafe { dots(x.as_ptr(), stride, rows, &qs, n, &mut sums) })
                    },
                );
            }
            let lanes = if n == kq::LANES_N {
                kq::lanes_kernels()
            } else {
                &[]
            };
            for (i, &lanes) in lanes.iter().enumerate() {
                let mut qt = Vec::new();
                kq::lanes_queries(&qs, m, &mut qt);
                let id = BenchmarkId::new(format!("lanes{i}"), q_rows);
                g.bench_with_input(id, &q_rows, |b, _| {
                    // SAFETY: the CPU runs it; rows of n f16 inside x; qt made for m rows.
                    b.iter(|| unsafe { lanes(x.as_ptr(), stride, rows, &qt, m, &mut sums) })
                });
            }
            g.bench_with_input(BenchmarkId::new("ggml", q_rows), &q_rows, |b, _| {
                b.iter(|| {
                    for r in 0..rows {
                        for k in 0..m {
                            let mut s = 0f32;
                            // SAFETY: one row of n f16 each.
                            unsafe {
                                vec_dot(
                                    n as i32,
                                    &mut s,
                                    0,
                                    x.as_ptr().add(r * stride).cast(),
                                    0,
                                    qh.as_ptr().add(k * n).cast(),
                                    0,
                                    1,
                                )
                            };
                            sums[r * m + k] = s;
                        }
                    }
                })
            });
        }
        g.finish();
    }
}

fn lone(c: &mut Criterion) {
    use leap_kernels::lone::{rows, Keys, Merge, Rounding, Values, HALF_STEP_AVX512FP16};
    let cells = 1024usize;
    for (name, dv, heads) in [("gemma", 256usize, 4usize), ("smollm", 64, 3)] {
        let mut g = c.benchmark_group(format!("lone/{name}"));
        let data: Vec<u16> = (0..cells * dv)
            .map(|i| leap_kernels::f16::from_f32(((i * 7919) % 101) as f32 * 0.02 - 1.0))
            .collect();
        let values = Values {
            data: &data,
            stride: dv,
            dv,
        };
        let mask = vec![0f32; cells];
        let mut ariths = vec![("f32", 0usize)];
        if leap_kernels::lone::half_ok() {
            ariths.push(("half", HALF_STEP_AVX512FP16));
        }
        for q_rows in [1usize, 8] {
            let m = heads * q_rows;
            // Scores that rise now and then, so that some cells rescale the accumulator.
            let scores: Vec<Vec<f32>> = (0..m)
                .map(|r| {
                    (0..cells)
                        .map(|c| ((c * 31 + r * 17) % 97) as f32 * 0.05 + c as f32 * 0.002)
                        .collect()
                })
                .collect();
            let keys: Vec<Keys<'_>> = scores
                .iter()
                .map(|s| Keys {
                    scores: s,
                    mask: &mask,
                })
                .collect();
            let mut out = vec![0f32; m * dv];
            for &(arith, half) in &ariths {
                let rounding = Rounding {
                    sum_fused: true,
                    merge: Merge::FirstFused,
                    half,
                };
                g.bench_with_input(BenchmarkId::new(arith, q_rows), &q_rows, |b, _| {
                    b.iter(|| {
                        let mut outs: Vec<&mut [f32]> = out.chunks_mut(dv).collect();
                        rows(&keys, 0.0625, values, 2, rounding, &mut outs)
                    })
                });
            }
        }
        g.finish();
    }
}

fn softmax(c: &mut Criterion) {
    use leap_kernels::softmax::{cpu_ok, row, Exp, Mask};
    let cells = 1024usize;
    let mut g = c.benchmark_group("softmax");
    for (name, exp) in [("zmm", Exp::Zmm), ("ymm", Exp::Ymm)] {
        if !cpu_ok(exp) {
            continue;
        }
        for tokens in [1usize, 8] {
            let rows = 9 * tokens;
            let x: Vec<f32> = (0..rows * cells)
                .map(|i| ((i * 7919) % 1013) as f32 * 0.01 - 5.0)
                .collect();
            let mask: Vec<u16> = (0..cells)
                .map(|c| {
                    if c < cells - 24 {
                        0
                    } else {
                        leap_kernels::f16::NEG_INFINITY
                    }
                })
                .collect();
            let mut y = vec![0f32; rows * cells];
            g.bench_with_input(BenchmarkId::new(name, tokens), &tokens, |b, _| {
                b.iter(|| {
                    for (x, y) in x.chunks(cells).zip(y.chunks_mut(cells)) {
                        row(exp, x, Mask::F16(&mask), 0.125, y);
                    }
                })
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(300)).measurement_time(std::time::Duration::from_secs(1));
    targets = qdot, stream, attention, lone, softmax
}
criterion_main!(benches);
