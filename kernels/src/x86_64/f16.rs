//! The attention loops with F16C's conversions and FMA (what Leap's x86-64 build enables).

use std::arch::x86_64::*;

/// The sum of a register's 8 lanes.
#[inline]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

#[inline]
pub unsafe fn dot(q: &[f32], k: *const u16) -> f32 {
    let n = q.len();
    let mut a0 = _mm256_setzero_ps();
    let mut a1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        let k0 = _mm256_cvtph_ps(_mm_loadu_si128(k.add(i).cast()));
        let k1 = _mm256_cvtph_ps(_mm_loadu_si128(k.add(i + 8).cast()));
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i)), k0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i + 8)), k1, a1);
        i += 16;
    }
    let mut sum = hsum(_mm256_add_ps(a0, a1));
    while i < n {
        sum += q[i] * super::to_f32(*k.add(i));
        i += 1;
    }
    sum
}

#[inline]
pub unsafe fn prefetch(p: *const u8, bytes: usize) {
    let mut o = 0;
    while o < bytes {
        _mm_prefetch::<_MM_HINT_T0>(p.add(o).cast());
        o += 64;
    }
}

/// out = Σ_r w[r] · rows[r], accumulating 64 columns at a time in registers.
pub unsafe fn weighted_sum(out: &mut [f32], w: &[f32], rows: &[*const u16]) {
    let n = out.len();
    let mut c0 = 0;
    while c0 + 64 <= n {
        let mut a = [_mm256_setzero_ps(); 8];
        for (r, &p) in rows.iter().enumerate() {
            if let Some(&next) = rows.get(r + 4) {
                _mm_prefetch::<_MM_HINT_T0>(next.add(c0).cast());
                _mm_prefetch::<_MM_HINT_T0>(next.add(c0 + 32).cast());
            }
            let wv = _mm256_set1_ps(*w.get_unchecked(r));
            let p = p.add(c0);
            for (x, acc) in a.iter_mut().enumerate() {
                let v = _mm256_cvtph_ps(_mm_loadu_si128(p.add(8 * x).cast()));
                *acc = _mm256_fmadd_ps(wv, v, *acc);
            }
        }
        for (x, acc) in a.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * x), *acc);
        }
        c0 += 64;
    }
    if c0 < n {
        let tail = &mut out[c0..];
        tail.fill(0.0);
        for (r, &p) in rows.iter().enumerate() {
            axpy(tail, w[r], p.add(c0));
        }
    }
}

#[inline]
pub unsafe fn axpy(acc: &mut [f32], w: f32, v: *const u16) {
    let n = acc.len();
    let wv = _mm256_set1_ps(w);
    let mut i = 0;
    while i + 8 <= n {
        let x = _mm256_cvtph_ps(_mm_loadu_si128(v.add(i).cast()));
        let p = acc.as_mut_ptr().add(i);
        _mm256_storeu_ps(p, _mm256_fmadd_ps(wv, x, _mm256_loadu_ps(p)));
        i += 8;
    }
    while i < n {
        acc[i] += w * super::to_f32(*v.add(i));
        i += 1;
    }
}
