//! Diagnostic: one thread, 65536 x 640 weights against 1, 2 and 4 activation rows, per kernel
//! (the 512-bit one, the 256-bit VNNI one, AVX2) for each non-k-quant type, the mean of 5
//! passes. `qdottime warm`: 512 x 640 weights (in L2) against 1, 4 and 8 rows, 128 passes a
//! measurement, the fastest of 15: the arithmetic alone, steadier where timings swing.
use leap_host::qdot::{Kernel, Kind};
fn main() {
    let warm = std::env::args().nth(1).as_deref() == Some("warm");
    let (n, rows_w) = (640usize, if warm { 512 } else { 65536 });
    // Row counts; passes a measurement; measurements (the fastest is printed); what a printed
    // time covers.
    let (row_counts, passes, tries, per): (&[usize], usize, usize, f64) = if warm {
        (&[1, 4, 8], 128, 15, 1.0)
    } else {
        (&[1, 2, 4], 5, 1, 5.0)
    };
    let nb = n / 32;
    for kind in [Kind::Q8_0, Kind::Q5_0, Kind::Q4_1] {
        // Blocks of patterned quants whose f16 scale (and Q4_1/Q8_1's second f16) is ~0.008.
        let blocks = |n: usize, len: usize, (x, y, m): (usize, usize, usize)| {
            let mut v = vec![0u8; n * len];
            for (i, b) in v.chunks_exact_mut(len).enumerate() {
                for (j, q) in b.iter_mut().enumerate() {
                    *q = ((i * x + j * y) % m) as u8;
                }
                b[..2].copy_from_slice(&[0x1f, 0x20]);
                if kind == Kind::Q4_1 {
                    b[2..4].copy_from_slice(&[0x1f, 0x20]);
                }
            }
            v
        };
        let w = blocks(rows_w * nb, kind.weight_block(), (31, 7, 251));
        let a = blocks(nb, kind.act_block(), (13, 5, 200));
        let k0 = Kernel::new(kind).unwrap();
        for (name, k) in [
            ("zmm", k0.with_zmm()),
            ("vnni256", k0.without_zmm()),
            ("avx2", k0.without_vnni()),
        ] {
            for &r in row_counts {
                let acts_v: Vec<&[u8]> = (0..r).map(|_| a.as_slice()).collect();
                let acts = k.prepare(n, &acts_v);
                let mut out = vec![0f32; 64 * r];
                let mut best = f64::MAX;
                for _ in 0..tries {
                    let t0 = std::time::Instant::now();
                    for _ in 0..passes {
                        for tile in w.chunks(64 * nb * kind.weight_block()) {
                            k.dot_many(&acts, tile, &mut out);
                        }
                    }
                    best = best.min(t0.elapsed().as_secs_f64() / per);
                }
                let what = if warm {
                    "128 passes, fastest of 15"
                } else {
                    "pass"
                };
                println!(
                    "{kind:?} {name} rows {r}: {:.2} ms per {what} (1 thread)",
                    best * 1e3
                );
            }
        }
    }
}
