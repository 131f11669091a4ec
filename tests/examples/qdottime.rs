//! Diagnostic: one thread, 65536 x 640 weights against 1, 2 and 4 activation rows, per kernel
//! (the 512-bit one, the 256-bit VNNI one, AVX2) for each non-k-quant type.
use leap_host::qdot::{Kernel, Kind};
fn main() {
    let (n, rows_w) = (640usize, 65536usize);
    let nb = n / 32;
    for kind in [Kind::Q8_0, Kind::Q5_0, Kind::Q4_1] {
        let (wb, ab) = (kind.weight_block(), kind.act_block());
        let mut w = vec![0u8; rows_w * nb * wb];
        for (i, b) in w.chunks_exact_mut(wb).enumerate() {
            for (j, q) in b.iter_mut().enumerate() {
                *q = ((i * 31 + j * 7) % 251) as u8;
            }
            b[0] = 0x1f;
            b[1] = 0x20;
            if kind == Kind::Q4_1 {
                b[2] = 0x1f;
                b[3] = 0x20;
            }
        }
        let mut a = vec![0u8; nb * ab];
        for (j, b) in a.chunks_exact_mut(ab).enumerate() {
            for (k, q) in b.iter_mut().enumerate() {
                *q = ((j * 13 + k * 5) % 200) as u8;
            }
            b[0] = 0x1f;
            b[1] = 0x20;
            if kind == Kind::Q4_1 {
                b[2] = 0x1f;
                b[3] = 0x20;
            }
        }
        let k0 = Kernel::new(kind).unwrap();
        for (name, k) in [
            ("zmm", k0),
            ("vnni256", k0.without_zmm()),
            ("avx2", k0.without_vnni()),
        ] {
            for r in [1usize, 2, 4] {
                let acts_v: Vec<&[u8]> = (0..r).map(|_| a.as_slice()).collect();
                let acts = k.prepare(n, &acts_v);
                let mut out = vec![0f32; 64 * r];
                let t0 = std::time::Instant::now();
                for _ in 0..5 {
                    for tile in w.chunks(64 * nb * wb) {
                        k.dot_many(&acts, tile, &mut out);
                    }
                }
                println!(
                    "{kind:?} {name} rows {r}: {:.2} ms per pass (1 thread)",
                    t0.elapsed().as_secs_f64() * 1e3 / 5.0
                );
            }
        }
    }
}
