//! The 32-weight block types (`Q8_0`, `Q5_0` x `Q8_0`; `Q4_1` x `Q8_1`): ggml's `vec_dot`
//! (nrc = 1) in each architecture's order.
//!
//! Per block, the 32 integer products are summed into lanes, each lane becomes an `f32`, and
//! is scaled by the block's scale product `dx * dy` (exact: two halves). Which products share
//! a lane, and how the scaled lanes are accumulated, is what differs:
//!
//! - [`Order::X86Avx2`]: 8 lanes of 4 consecutive elements, accumulated block after block with
//!   one fused multiply-add, reduced by `hsum_float_8`; `Q4_1` adds its `m * s` terms
//!   (exact products) to a scalar `summs`, added last.
//! - [`Order::Neon`] / [`Order::NeonDotprod`]: 4 lanes per block, each the products of the
//!   elements `16h + {2l, 2l+1, 2l+8, 2l+9}` (ggml's `ggml_vdotq_s32` emulation:
//!   `vmull_s8` + `vpaddlq_s16`) or `16h + 4l..4l+3` (`vdotq_s32`), h = 0, 1. Blocks go in
//!   pairs: the first of a pair into `sumv0`, the second into `sumv1`, each as an unfused
//!   multiply then add (gcc's `vmlaq_n_f32`); the sums are reduced as `(l0+l1)+(l2+l3)`
//!   (`vaddvq_f32`), and an odd last block is added by the scalar tail with a fused
//!   multiply-add (`sumf += sumi * d`; for `Q4_1`, `sumf += fma(d, sumi, m * s)`), as gcc
//!   compiled Leap's armv8-a ggml.

use super::Order;
use crate::qdot::Kind;

fn half(b: &[u8], at: usize) -> f32 {
    crate::f16::to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// A weight block's 32 values, element j at index j (ggml's order: low nibbles are elements
/// 0..15, high nibbles 16..31).
fn weights(kind: Kind, x: &[u8]) -> [i32; 32] {
    let mut v = [0i32; 32];
    match kind {
        Kind::Q8_0 => {
            for (v, &q) in v.iter_mut().zip(&x[2..34]) {
                *v = i32::from(q as i8);
            }
        }
        Kind::Q5_0 => {
            let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
            for j in 0..16 {
                let q = x[6 + j];
                let hi = |bit: usize| ((qh >> bit) & 1) as i32 * 16;
                v[j] = i32::from(q & 0x0F) + hi(j) - 16;
                v[j + 16] = i32::from(q >> 4) + hi(j + 16) - 16;
            }
        }
        Kind::Q4_1 => {
            for j in 0..16 {
                v[j] = i32::from(x[4 + j] & 0x0F);
                v[j + 16] = i32::from(x[4 + j] >> 4);
            }
        }
        Kind::Q4K | Kind::Q6K => unreachable!("k-quants have their own reference"),
    }
    v
}

/// Which lane element `j` (0..32) of a block falls in.
fn lane(order: Order, j: usize) -> usize {
    match order {
        Order::X86Avx2 => j / 4,
        Order::NeonDotprod => (j % 16) / 4,
        // Bytes 2l, 2l+1 (first `vmull_s8`) and 2l+8, 2l+9 (second) of each 16.
        Order::Neon => (j % 8) / 2,
    }
}

/// One block's integer lanes (4 on ARM, 8 on x86).
fn lanes(kind: Kind, order: Order, x: &[u8], y: &[u8]) -> [i32; 8] {
    let (w, q) = (
        weights(kind, x),
        &y[kind.act_block() - 32..kind.act_block()],
    );
    let mut l = [0i32; 8];
    for (j, (&w, &q)) in w.iter().zip(q).enumerate() {
        l[lane(order, j)] += w * i32::from(q as i8);
    }
    l
}

/// ggml's `vaddvq_f32` as gcc emits it (two `faddp`).
fn addv(v: [f32; 4]) -> f32 {
    (v[0] + v[1]) + (v[2] + v[3])
}

/// ggml's `hsum_float_8`.
fn hsum8(a: &[f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|i| a[i + 4] + a[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

pub(super) fn dot(kind: Kind, order: Order, nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wb, ab) = (kind.weight_block(), kind.act_block());
    let x = |b: usize| &w[b * wb..(b + 1) * wb];
    let y = |b: usize| &a[b * ab..(b + 1) * ab];
    // Scale product, and for Q4_1 the m * s term (both exact in f32).
    let d = |b: usize| half(x(b), 0) * half(y(b), 0);
    let ms = |b: usize| half(x(b), 2) * half(y(b), 2);
    if order == Order::X86Avx2 {
        let (mut acc, mut summs) = ([0.0f32; 8], 0.0f32);
        for b in 0..nb {
            let l = lanes(kind, order, x(b), y(b));
            for (acc, &l) in acc.iter_mut().zip(&l) {
                *acc = d(b).mul_add(l as f32, *acc);
            }
            if kind == Kind::Q4_1 {
                summs += ms(b);
            }
        }
        return if kind == Kind::Q4_1 {
            hsum8(&acc) + summs
        } else {
            hsum8(&acc)
        };
    }
    let (mut sumv, mut summs) = ([[0.0f32; 4]; 2], 0.0f32);
    for b in 0..nb / 2 * 2 {
        let l = lanes(kind, order, x(b), y(b));
        for (s, &l) in sumv[b % 2].iter_mut().zip(&l) {
            *s += l as f32 * d(b);
        }
        if kind == Kind::Q4_1 && b % 2 == 1 {
            summs += ms(b - 1) + ms(b);
        }
    }
    let mut sumf = addv(sumv[0]) + addv(sumv[1]);
    if kind == Kind::Q4_1 {
        sumf += summs;
    }
    if nb % 2 == 1 {
        let b = nb - 1;
        let sumi = lanes(kind, order, x(b), y(b)).iter().sum::<i32>() as f32;
        sumf = if kind == Kind::Q4_1 {
            sumf + d(b).mul_add(sumi, ms(b))
        } else {
            sumi.mul_add(d(b), sumf)
        };
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::Order;
    use crate::f16::from_f32;
    use crate::qdot::{Kernel, Kind};
    use crate::reference::dot;

    /// xorshift64*: reproducible data without dependencies.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        /// A finite half of magnitude 2^-24 (subnormal) to 2^5, either sign, sometimes zero.
        fn half(&mut self) -> u16 {
            let sign = (self.below(2) as u16) << 15;
            match self.below(16) {
                0 => sign,
                1 => sign | self.below(0x400) as u16,
                _ => sign | ((1 + self.below(20)) as u16) << 10 | self.below(0x400) as u16,
            }
        }

        /// An activation quant as ggml's quantizers make them (-127..=127: x86's
        /// `_mm256_sign_epi8` trick, which ggml and Leap share, is wrong for -128).
        fn act_quant(&mut self) -> u8 {
            (self.below(255) as i32 - 127) as i8 as u8
        }
    }

    /// `rows` rows of `nb` blocks of `kind`'s weights.
    fn weight_rows(rng: &mut Rng, kind: Kind, nb: usize, rows: usize) -> Vec<u8> {
        let mut w = Vec::new();
        for _ in 0..rows * nb {
            w.extend(rng.half().to_le_bytes());
            if kind == Kind::Q4_1 {
                w.extend(rng.half().to_le_bytes());
            }
            let quants = kind.weight_block() - w.len() % kind.weight_block();
            w.extend((0..quants).map(|_| rng.next() as u8));
        }
        w
    }

    /// An activation row (`Q8_0`, or `Q8_1` with its `s` either `d * sum(q)` or unrelated).
    fn act_row(rng: &mut Rng, kind: Kind, nb: usize) -> Vec<u8> {
        let mut a = Vec::new();
        for _ in 0..nb {
            let d = rng.half();
            let q: Vec<u8> = (0..32).map(|_| rng.act_quant()).collect();
            a.extend(d.to_le_bytes());
            if kind == Kind::Q4_1 {
                let sum: i32 = q.iter().map(|&q| i32::from(q as i8)).sum();
                let s = if rng.below(2) == 0 {
                    from_f32(crate::f16::to_f32(d) * sum as f32)
                } else {
                    rng.half()
                };
                a.extend(s.to_le_bytes());
            }
            a.extend(q);
        }
        a
    }

    /// Every kernel variant this CPU can run, with the order of the ggml it must match.
    fn variants(kind: Kind) -> Vec<(Kernel, Order)> {
        let Some(k) = Kernel::new(kind) else {
            eprintln!("no {kind:?} kernel on this CPU: only the reference is tested");
            return Vec::new();
        };
        if cfg!(target_arch = "aarch64") {
            [false, true]
                .into_iter()
                .flat_map(|on| {
                    let order = if on { Order::NeonDotprod } else { Order::Neon };
                    [k, k.without_i8mm(), k.without_dotprod()]
                        .map(|k| (k.for_ggml_dotprod(on), order))
                })
                .collect()
        } else {
            [k, k.without_vnni(), k.without_zmm(), k.with_zmm()]
                .map(|k| (k, Order::X86Avx2))
                .to_vec()
        }
    }

    #[test]
    fn kernels_match_the_reference_bit_for_bit() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for kind in [Kind::Q8_0, Kind::Q5_0, Kind::Q4_1] {
            for (k, order) in variants(kind) {
                // 33 and 70 blocks: rows longer than the 256-bit kernels' chunk of scale
                // products (32 blocks).
                for nb in [1, 2, 3, 4, 7, 8, 33, 70] {
                    for rows in 1..=17 {
                        let n = nb * 32;
                        // 7 weight rows: passes of two, then the odd last one; rows past
                        // two 8-row groups.
                        let w = weight_rows(&mut rng, kind, nb, 7);
                        let acts: Vec<Vec<u8>> =
                            (0..rows).map(|_| act_row(&mut rng, kind, nb)).collect();
                        let refs: Vec<&[u8]> = acts.iter().map(|a| a.as_slice()).collect();
                        let prepared = k.prepare(n, &refs);
                        let mut out = vec![0.0f32; 7 * rows];
                        k.dot_many(&prepared, &w, &mut out);
                        let row = nb * kind.weight_block();
                        for (i, x) in w.chunks_exact(row).enumerate() {
                            for (r, a) in refs.iter().enumerate() {
                                let want = dot(kind, order, n, x, a);
                                let got = out[i * rows + r];
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{kind:?} {} ggml {order:?}, {nb} blocks, {rows} rows: \
                                     weight row {i} x row {r}: {got:e} != {want:e}",
                                    k.variant()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// With unit scales and small sums every float operation is exact: every order gives the
    /// integer dot product (so the unpacking and pairing are right, whatever the rounding).
    #[test]
    fn exact_data_gives_the_integer_dot_in_every_order() {
        let mut rng = Rng(7);
        for kind in [Kind::Q8_0, Kind::Q5_0, Kind::Q4_1] {
            for nb in [1, 2, 5] {
                let mut w = weight_rows(&mut rng, kind, nb, 1);
                let mut a = act_row(&mut rng, kind, nb);
                let (wb, ab) = (kind.weight_block(), kind.act_block());
                let mut want = 0i64;
                for b in 0..nb {
                    w[b * wb..b * wb + 2].copy_from_slice(&0x3c00u16.to_le_bytes());
                    a[b * ab..b * ab + 2].copy_from_slice(&0x3c00u16.to_le_bytes());
                    if kind == Kind::Q4_1 {
                        // m = 2, s = 3: each block adds 6.
                        w[b * wb + 2..b * wb + 4].copy_from_slice(&0x4000u16.to_le_bytes());
                        a[b * ab + 2..b * ab + 4].copy_from_slice(&0x4200u16.to_le_bytes());
                        want += 6;
                    }
                    let x = super::weights(kind, &w[b * wb..]);
                    want += x
                        .iter()
                        .zip(&a[b * ab + ab - 32..(b + 1) * ab])
                        .map(|(&x, &y)| i64::from(x) * i64::from(y as i8))
                        .sum::<i64>();
                }
                for order in [Order::X86Avx2, Order::Neon, Order::NeonDotprod] {
                    assert_eq!(
                        dot(kind, order, nb * 32, &w, &a),
                        want as f32,
                        "{kind:?} {order:?}"
                    );
                }
            }
        }
    }

    /// The unpacked weights are ggml's: spot values of each type.
    #[test]
    fn weights_unpack_as_ggml() {
        let mut q8 = [0u8; 34];
        q8[2] = 0x80;
        q8[33] = 0x7f;
        let v = super::weights(Kind::Q8_0, &q8);
        assert_eq!((v[0], v[31]), (-128, 127));
        // Q5_0: element 0 = nibble 0x3 with bit 0 set (19 - 16 = 3), element 16 = nibble 0xA
        // with bit 16 clear (10 - 16), element 31 = nibble 0xF with bit 31 set (15).
        let mut q5 = [0u8; 22];
        q5[2..6].copy_from_slice(&(1u32 | 1 << 31).to_le_bytes());
        q5[6] = 0xA3;
        q5[21] = 0xF0;
        let v = super::weights(Kind::Q5_0, &q5);
        assert_eq!((v[0], v[16], v[15], v[31]), (3, -6, -16, 15));
        let mut q4 = [0u8; 20];
        q4[4] = 0x5C;
        let v = super::weights(Kind::Q4_1, &q4);
        assert_eq!((v[0], v[16], v[1]), (12, 5, 0));
    }

    /// The orders differ on ordinary data: the lanes and accumulation are really modelled.
    #[test]
    fn orders_round_differently() {
        let mut rng = Rng(11);
        let kind = Kind::Q8_0;
        let (mut neon_dotprod, mut neon_x86) = (false, false);
        for _ in 0..200 {
            let w = weight_rows(&mut rng, kind, 4, 1);
            let a = act_row(&mut rng, kind, 4);
            let [x86, neon, dotprod] = [Order::X86Avx2, Order::Neon, Order::NeonDotprod]
                .map(|o| dot(kind, o, 128, &w, &a).to_bits());
            neon_dotprod |= neon != dotprod;
            neon_x86 |= neon != x86;
        }
        assert!(neon_dotprod && neon_x86);
    }
}
