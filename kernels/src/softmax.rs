//! Attention's softmax rows without flash attention (`GGML_OP_SOFT_MAX` with a scale and an
//! optional mask, no ALiBi, no sinks), bit for bit as ggml's CPU backend computes one row, but
//! in three passes over the row instead of six, the mask's f16 widened 8 or 16 at a time
//! where ggml widens one element at a time.
//!
//! ggml's row (`ggml_compute_forward_soft_max_f32`): `w = x * scale`, then `w += 1.0 * mask`,
//! the maximum of `w` by `a > b ? a : b` from the left, then `ggml_vec_soft_max_f32`: whole
//! vectors of `exp(w - max)` by `ggml_v_expf` (a polynomial with its own rounding, different
//! for each instruction set ggml was built for: [`Exp`]), each vector's lanes reduced to one
//! f32 in a fixed tree and added to an f64 sum, the tail by libm's `expf`, then every value
//! times `(float)(1.0 / sum)`. Each step here is the same operation on the same operands:
//! - the products and sums are elementwise, so their vector width does not matter;
//! - the maximum of values without a NaN is the same in any order (a `+0`/`-0` tie can differ
//!   in sign, and `w - max` then differs only for `w = -0`, whose exponential is 1 either way);
//!   a row holding a NaN takes ggml's left-to-right comparisons instead;
//! - the exponentials and the sum run in ggml's vector width and tree, on the same elements.
//!
//! Which `ggml_v_expf` a process's ggml runs is a property of how it was compiled, not of the
//! CPU: the caller (`leap_backend::softmax`) runs ggml's own op once and keeps the [`Exp`]
//! that reproduces it, or none.

#[cfg(target_arch = "x86_64")]
#[path = "x86_64/softmax.rs"]
mod x86;

/// The `ggml_v_expf` and lane reduction of a ggml build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exp {
    /// Built with AVX-512F and AVX-512DQ: 16 lanes, the result scaled by `vscalefps`, lanes
    /// reduced by GCC's `_mm512_reduce_add_ps` (256-bit halves, 128-bit halves, pairs).
    Zmm,
    /// Built with AVX2 and FMA: 8 lanes, the result scaled through its exponent bits, lanes
    /// reduced as ggml's `hsum` (128-bit halves, then `movehl`, then `movehdup`).
    Ymm,
}

impl Exp {
    /// Elements a vector step takes.
    #[cfg(test)]
    fn lanes(self) -> usize {
        match self {
            Exp::Zmm => 16,
            Exp::Ymm => 8,
        }
    }
}

/// The mask added to a row, as ggml's node holds it (or none).
#[derive(Clone, Copy, Debug)]
pub enum Mask<'a> {
    None,
    F16(&'a [u16]),
    F32(&'a [f32]),
}

/// Whether this CPU runs the kernel for `exp` (x86-64: AVX2, FMA and F16C; `Zmm` also
/// AVX-512F/DQ). None on other architectures yet: their rows stay with ggml.
pub fn cpu_ok(exp: Exp) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86::cpu_ok(exp)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = exp;
        false
    }
}

/// One softmax row: `y = softmax(x * scale + mask)` as ggml's build `exp` computes it (see the
/// module's description).
///
/// # Panics
/// Lengths differ (the mask's too), or the CPU does not run `exp` ([`cpu_ok`]).
pub fn row(exp: Exp, x: &[f32], mask: Mask<'_>, scale: f32, y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    match mask {
        Mask::None => {}
        Mask::F16(m) => assert_eq!(m.len(), x.len()),
        Mask::F32(m) => assert_eq!(m.len(), x.len()),
    }
    assert!(cpu_ok(exp), "the CPU does not run this softmax kernel");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: checked above.
    unsafe {
        x86::row(exp, x, mask, scale, y)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (scale, y);
}

/// SwiGLU's unit, `y = silu(x) * g` element by element, as ggml's build `exp` computes it
/// (`ggml_vec_swiglu_f32`: `ggml_v_silu`, `x / (1 + exp(0 - x))` with that build's `exp`, over
/// whole vectors of its width, libm's `expf` for the tail).
///
/// # Panics
/// Lengths differ, or the CPU does not run `exp` ([`cpu_ok`]).
pub fn swiglu(exp: Exp, x: &[f32], g: &[f32], y: &mut [f32]) {
    assert!(x.len() == y.len() && g.len() == y.len());
    assert!(cpu_ok(exp), "the CPU does not run this kernel");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: checked above.
    unsafe {
        x86::swiglu(exp, x, g, y)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = y;
}

/// ggml's `MAX(max, v)` from the left over `w`, starting at `-inf`.
#[cfg(any(test, target_arch = "x86_64"))]
fn ggml_max(w: &[f32]) -> f32 {
    w.iter()
        .fold(f32::NEG_INFINITY, |m, &v| if m > v { m } else { v })
}

/// The scalar transcription of one `ggml_v_expf` lane of build `exp` (its fused steps as
/// `mul_add`): what the kernels' tests hold the vector code to.
#[cfg(test)]
fn exp_lane(exp: Exp, x: f32) -> f32 {
    let c = |b: u32| f32::from_bits(b);
    let r = c(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(c(0x3fb8_aa3b), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let u = b * b;
    let p = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)));
    match exp {
        Exp::Zmm => {
            let j = p.mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
            if n.abs() > 192.0 {
                return if n <= 0.0 { 0.0 } else { f32::INFINITY };
            }
            // vscalefps: j * 2^n (n integral here) rounded once, as the f64 product rounds.
            (f64::from(j) * 2f64.powi(n as i32)) as f32
        }
        Exp::Ymm => {
            let j = p.mul_add(u, c(0x3f7f_fff6) * b);
            let e = z.to_bits() << 23;
            let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
            if n.abs() <= 126.0 {
                return j.mul_add(k, k);
            }
            let g = if n <= 0.0 { 0x8200_0000u32 } else { 0 };
            let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
            let s2 = f32::from_bits(e.wrapping_sub(g));
            if n.abs() > 192.0 {
                s1 * s1
            } else {
                s2.mul_add(j, s2) * s1
            }
        }
    }
}

/// ggml's reduction of one vector of `exp`'s width to a single f32.
#[cfg(test)]
fn reduce_lanes(exp: Exp, v: &[f32]) -> f32 {
    match exp {
        Exp::Zmm => {
            let t3: Vec<f32> = (0..8).map(|i| v[i + 8] + v[i]).collect();
            let t6: Vec<f32> = (0..4).map(|i| t3[i + 4] + t3[i]).collect();
            (t6[0] + t6[2]) + (t6[1] + t6[3])
        }
        Exp::Ymm => {
            let r: Vec<f32> = (0..4).map(|i| v[i + 4] + v[i]).collect();
            (r[0] + r[2]) + (r[1] + r[3])
        }
    }
}

/// [`row`] one element at a time, in ggml's order: what the kernels are tested against.
#[cfg(test)]
fn row_scalar(exp: Exp, x: &[f32], mask: Mask<'_>, scale: f32, y: &mut [f32]) {
    let mut w: Vec<f32> = x.iter().map(|&v| v * scale).collect();
    match mask {
        Mask::None => {}
        Mask::F16(m) => w
            .iter_mut()
            .zip(m)
            .for_each(|(w, &h)| *w += crate::f16::to_f32(h)),
        Mask::F32(m) => w.iter_mut().zip(m).for_each(|(w, &h)| *w += h),
    }
    let max = ggml_max(&w);
    let l = exp.lanes();
    let mut sum = 0f64;
    let whole = w.len() / l * l;
    for (i, chunk) in w[..whole].chunks_exact(l).enumerate() {
        let v: Vec<f32> = chunk.iter().map(|&v| exp_lane(exp, v - max)).collect();
        y[i * l..(i + 1) * l].copy_from_slice(&v);
        sum += f64::from(reduce_lanes(exp, &v));
    }
    for i in whole..w.len() {
        let v = (w[i] - max).exp();
        sum += f64::from(v);
        y[i] = v;
    }
    let s = (1.0 / sum) as f32;
    y.iter_mut().for_each(|v| *v *= s);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of every length around the vector widths, with and without a mask (f16 and f32,
    /// cells hidden by `-inf`, a hidden half as a sliding window's), scales below and above 1,
    /// values whose exponentials go past both of `ggml_v_expf`'s cut-offs (126 and 192
    /// binades), a whole row masked, and a row holding a NaN: the kernel gives the scalar
    /// transcription's bits, for each build's arithmetic the CPU runs.
    #[test]
    fn rows_match_the_scalar_transcription() {
        let mut rnd = crate::rng::XorShift::new(0x5eed_50f7);
        let mut checked = 0;
        for exp in [Exp::Zmm, Exp::Ymm] {
            if !cpu_ok(exp) {
                eprintln!("the CPU does not run the {exp:?} kernel");
                continue;
            }
            for n in [1usize, 7, 8, 9, 15, 16, 17, 31, 64, 100, 256, 1000, 1027] {
                for case in 0..7 {
                    let spread = [1.0f32, 8.0, 60.0, 200.0, 0.3, 30.0, 5.0][case];
                    let x: Vec<f32> = (0..n).map(|_| spread * rnd.signed()).collect();
                    let m16: Vec<u16> = (0..n)
                        .map(|i| match (case, i % 5) {
                            (4, _) => 0xfc00,
                            // A sliding window's row: a hidden prefix (whole vectors the
                            // kernel writes as 0 without `exp`) and a few hidden last cells.
                            (6, _) if i < n / 2 || i + 3 >= n => 0xfc00,
                            (6, _) => crate::f16::from_f32(rnd.signed()),
                            (_, 0) => 0xfc00,
                            _ => crate::f16::from_f32(rnd.signed() - 1.0),
                        })
                        .collect();
                    let m32: Vec<f32> = m16.iter().map(|&h| crate::f16::to_f32(h)).collect();
                    let mut xs = x.clone();
                    if case == 5 {
                        xs[n / 2] = f32::NAN;
                    }
                    for (scale, mask) in [
                        (0.125f32, Mask::None),
                        (1.0, Mask::F16(&m16)),
                        (0.7, Mask::F32(&m32)),
                    ] {
                        let (mut want, mut got) = (vec![0f32; n], vec![0f32; n]);
                        row_scalar(exp, &xs, mask, scale, &mut want);
                        row(exp, &xs, mask, scale, &mut got);
                        same_bits(&want, &got, |i| {
                            format!("{exp:?} n {n} case {case} scale {scale} element {i}")
                        });
                        checked += 1;
                        // An AVX2 build's arithmetic 8 lanes at a time too, where the CPU
                        // would run it 16 at a time.
                        #[cfg(target_arch = "x86_64")]
                        if exp == Exp::Ymm && cpu_ok(Exp::Zmm) {
                            // SAFETY: the CPU runs the 8-lane passes (`cpu_ok`); equal lengths.
                            unsafe { x86::row_on(exp, false, &xs, mask, scale, &mut got) };
                            same_bits(&want, &got, |i| {
                                format!("8 lanes: n {n} case {case} scale {scale} element {i}")
                            });
                        }
                    }
                }
            }
        }
        if checked > 0 {
            eprintln!("{checked} rows checked");
        }
    }

    /// `got` is `want` bit for bit, NaNs aside (a NaN's payload is whichever operand the
    /// compiler put first); `what(i)` names element i in the failure.
    fn same_bits(want: &[f32], got: &[f32], what: impl Fn(usize) -> String) {
        assert_eq!(want.len(), got.len());
        for (i, (w, g)) in want.iter().zip(got).enumerate() {
            let same = w.to_bits() == g.to_bits() || (w.is_nan() && g.is_nan());
            assert!(same, "{}: {w} vs {g}", what(i));
        }
    }

    /// SwiGLU's unit gives the scalar transcription's bits (`x / (1 + exp(0 - x)) * g` with
    /// the build's `exp` over whole vectors, libm's `expf` for the tail) for lengths around
    /// the vector widths and values past `exp`'s cut-offs, zeros of both signs, infinities.
    #[test]
    fn swiglu_matches_the_scalar_transcription() {
        let mut rnd = crate::rng::XorShift::new(0x5eed_5a1f);
        for exp in [Exp::Zmm, Exp::Ymm] {
            if !cpu_ok(exp) {
                eprintln!("the CPU does not run the {exp:?} kernel");
                continue;
            }
            let width = exp.lanes();
            for n in [1usize, 7, 8, 9, 16, 17, 33, 576, 1536, 1539] {
                let x: Vec<f32> = (0..n)
                    .map(|i| match i % 23 {
                        3 => 0.0,
                        4 => -0.0,
                        5 => 150.0,
                        6 => -150.0,
                        7 => f32::INFINITY,
                        8 => 100.0 * rnd.signed(),
                        _ => 6.0 * rnd.signed(),
                    })
                    .collect();
                let g: Vec<f32> = (0..n).map(|_| 3.0 * rnd.signed()).collect();
                let whole = n / width * width;
                let want: Vec<f32> = (0..n)
                    .map(|i| {
                        let e = if i < whole {
                            exp_lane(exp, 0.0 - x[i])
                        } else {
                            (-x[i]).exp()
                        };
                        x[i] / (1.0 + e) * g[i]
                    })
                    .collect();
                let mut got = vec![0f32; n];
                swiglu(exp, &x, &g, &mut got);
                same_bits(&want, &got, |i| {
                    format!("{exp:?} n {n} element {i} (x {})", x[i])
                });
            }
        }
    }

    /// The transcription's exponential is close to the true one where it is finite and
    /// normal (so the constants read off ggml are the right ones), 0 far below and infinity
    /// far above.
    #[test]
    fn the_transcribed_exponential_is_an_exponential() {
        for exp in [Exp::Zmm, Exp::Ymm] {
            for i in -870..=870 {
                let x = i as f32 * 0.1;
                let (got, want) = (exp_lane(exp, x), (x as f64).exp());
                if want > 1e-37 && want < 3e38 {
                    assert!(
                        ((got as f64 - want) / want).abs() < 1e-6,
                        "{exp:?} exp({x}) = {got}, want {want}"
                    );
                }
            }
            assert_eq!(exp_lane(exp, -200.0), 0.0);
            assert_eq!(exp_lane(exp, f32::NEG_INFINITY), 0.0);
            assert_eq!(exp_lane(exp, 200.0), f32::INFINITY);
        }
    }
}
