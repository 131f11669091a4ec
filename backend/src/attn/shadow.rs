//! The int8 shadow of the K caches: a `Q8_0` copy (a scale per 32 values) of each K cache
//! whose attention the device takes (every layer's in this llama.cpp, sliding-window ones
//! included), one per layer per context ([`MAX_SHADOWS`] at most, the least recently used
//! dropped first), written as the device takes the cache's `SET_ROWS` nodes (`op.rs`); cells
//! it did not write are quantized from the f16 cache when a node reads them. [`Keys8`] is the
//! view the estimate reads a node's keys through.

use std::sync::Mutex;

use crate::f16;
use crate::ffi as g;

pub(super) const QK: usize = 32;
pub(super) const Q8_BYTES: usize = 34;

fn cpu_traits(t: g::ggml_type) -> &'static g::ggml_type_traits_cpu {
    // SAFETY: ggml returns a static table entry for every type.
    unsafe { &*g::ggml_get_type_traits_cpu(t) }
}

type FromFloat = unsafe extern "C" fn(*const f32, *mut std::ffi::c_void, i64);

/// ggml's CPU conversion of f32 rows to type `t` (its traits' `from_float`).
pub(crate) fn quantizer(t: g::ggml_type) -> FromFloat {
    cpu_traits(t).from_float.expect("ggml quantizes this type")
}

/// An int8 copy of one K cache.
pub(super) struct Shadow {
    base: usize,
    pub(super) cells: usize,
    pub(super) n_embd: usize,
    pub(super) row_bytes: usize,
    pub(super) data: Vec<u8>,
    pub(super) valid: Vec<bool>,
    used: u64,
}

/// Every context's shadows (keyed by their cache's address and shape).
pub(super) struct Shadows {
    /// Bumped for every lookup (least recently used).
    tick: u64,
    list: Vec<Shadow>,
}

/// A context's settings are fixed when it is made, so a K cache is written by the device
/// (sparse attention on) or by ggml (off) for its whole life: a shadow never goes stale
/// behind the device's back.
pub(super) static SHADOWS: Mutex<Shadows> = Mutex::new(Shadows {
    tick: 0,
    list: Vec::new(),
});
/// Shadows kept (one per layer per context; the least recently used goes first).
const MAX_SHADOWS: usize = 256;

pub(super) fn shadow_for<'a>(shadows: &'a mut Shadows, root: &g::ggml_tensor) -> &'a mut Shadow {
    shadows.tick += 1;
    let tick = shadows.tick;
    let list = &mut shadows.list;
    let base = root.data as usize;
    let n_embd = root.ne[0] as usize;
    let cells = (root.ne[1] * root.ne[2] * root.ne[3]) as usize;
    let pos = list
        .iter()
        .position(|s| s.base == base && s.cells == cells && s.n_embd == n_embd);
    let i = match pos {
        Some(i) => i,
        None => {
            if list.len() >= MAX_SHADOWS {
                let lru = (0..list.len()).min_by_key(|&i| list[i].used).unwrap();
                list.swap_remove(lru);
            }
            let row_bytes = n_embd / QK * Q8_BYTES;
            list.push(Shadow {
                base,
                cells,
                n_embd,
                row_bytes,
                data: vec![0; cells * row_bytes],
                valid: vec![false; cells],
                used: tick,
            });
            list.len() - 1
        }
    };
    let s = &mut list[i];
    s.used = tick;
    s
}

/// Where the int8 copy of key `j` of head `h` is: `base + (cell0 + j)*row + col0 + h*head`
/// (`len` bytes from `base` are readable).
#[derive(Clone, Copy, Debug)]
pub struct Keys8 {
    pub base: *const u8,
    pub len: usize,
    pub cell0: usize,
    pub row: usize,
    pub col0: usize,
    pub head: usize,
}

// SAFETY: a read-only view.
unsafe impl Send for Keys8 {}
unsafe impl Sync for Keys8 {}

impl Keys8 {
    /// Where key `j` of head `h` starts.
    ///
    /// # Safety
    /// `j` and `h` within the view (the result is then inside the `len` readable bytes).
    #[inline]
    pub unsafe fn at(&self, j: usize, h: usize) -> *const u8 {
        self.base
            .add((self.cell0 + j) * self.row + self.col0 + h * self.head)
    }
}

/// Quantize `rows` f16 rows of `n` values (`stride` bytes apart) to Q8_0 rows (`out_row`
/// bytes apart), for shadows filled from a cache.
///
/// # Safety
/// Pointers valid for the rows.
pub unsafe fn quantize_f16_rows(
    src: *const u8,
    stride: usize,
    rows: usize,
    n: usize,
    out: *mut u8,
) {
    let to_q8 = quantizer(g::GGML_TYPE_Q8_0);
    let row_bytes = n / QK * Q8_BYTES;
    let mut tmp = vec![0f32; n];
    for r in 0..rows {
        let p = src.add(r * stride).cast::<u16>();
        for (x, t) in tmp.iter_mut().enumerate() {
            *t = f16::to_f32(*p.add(x));
        }
        to_q8(tmp.as_ptr(), out.add(r * row_bytes).cast(), n as i64);
    }
}

/// Bytes of a Q8_0 row of `n` values.
pub fn q8_row_bytes(n: usize) -> usize {
    n / QK * Q8_BYTES
}
