//! Weight-stationary dot products of one quantized weight row against several activation rows,
//! each bit-identical to ggml's single-row `vec_dot` for the type.
//!
//! ggml's CPU `mul_mat` computes every output element with one `vec_dot` call: for k activation
//! rows it unpacks each weight block k times. These kernels unpack it once and reuse it for
//! every row. They keep ggml's arithmetic exactly, so a row's result does not depend on how many
//! rows were computed with it (the batch invariance greedy speculation needs): per 32-weight
//! block the integer products are summed into the same 8 lanes (elements 4m..4m+3), each lane
//! is converted to `f32` and accumulated with one fused multiply-add by the block's scale
//! product, block after block, and the 8 lanes are reduced in ggml's `hsum_float_8` order.
//!
//! x86-64 with AVX2/FMA/F16C (what ggml's own single-row kernels use in Leap's build) in
//! `x86_64/`, and AArch64 with NEON (dotprod and i8mm chosen at run time) in `aarch64/`;
//! [`Kernel::new`] returns `None` elsewhere and callers fall back to ggml's `vec_dot` one row at
//! a time. Callers check a kernel against ggml on random data ([`Kernel::agrees`]) before use;
//! [`crate::reference`] is the same arithmetic in portable scalar code, which every
//! architecture's kernels are tested against.

/// A weight type with a weight-stationary kernel here, and the activation type it pairs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// `Q8_0` weights x `Q8_0` activations.
    Q8_0,
    /// `Q5_0` weights x `Q8_0` activations.
    Q5_0,
    /// `Q4_1` weights x `Q8_1` activations.
    Q4_1,
    /// `Q4_K` weights (super-blocks of 256) x `Q8_K` activations.
    Q4K,
    /// `Q6_K` weights x `Q8_K` activations.
    Q6K,
}

impl Kind {
    /// The kind whose discriminant (`kind as u8`) is `v`: the kernels take a kind as a const
    /// parameter, so that each one's loop is compiled for it.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Q8_0,
            1 => Self::Q5_0,
            2 => Self::Q4_1,
            3 => Self::Q4K,
            _ => Self::Q6K,
        }
    }

    /// The kernel for a ggml type name, if there is one.
    pub fn from_ggml_name(name: &str) -> Option<Self> {
        match name {
            "q8_0" => Some(Self::Q8_0),
            "q5_0" => Some(Self::Q5_0),
            "q4_1" => Some(Self::Q4_1),
            "q4_K" => Some(Self::Q4K),
            "q6_K" => Some(Self::Q6K),
            _ => None,
        }
    }

    /// Values per block (32, or 256 for the k-quants' super-blocks).
    pub fn block_len(self) -> usize {
        if self.is_k() {
            QK_K
        } else {
            32
        }
    }

    /// A k-quant (super-blocks, `Q8_K` activations).
    pub fn is_k(self) -> bool {
        matches!(self, Self::Q4K | Self::Q6K)
    }

    /// Bytes of one weight block ([`Kind::block_len`] weights).
    pub fn weight_block(self) -> usize {
        match self {
            Self::Q8_0 => 34,
            Self::Q5_0 => 22,
            Self::Q4_1 => 20,
            Self::Q4K => Q4K_BYTES,
            Self::Q6K => Q6K_BYTES,
        }
    }

    /// Bytes of one activation block (`Q8_0`: 34, `Q8_1`: 36, `Q8_K`: 292).
    pub fn act_block(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q5_0 => 34,
            Self::Q4_1 => 36,
            Self::Q4K | Self::Q6K => Q8K_BYTES,
        }
    }
}

/// Sizes of the k-quants' super-blocks.
mod ksize {
    /// Values per super-block.
    pub(crate) const QK_K: usize = 256;
    /// Bytes of a `Q8_K` super-block: `f32 d`, 256 `i8` quants, 16 `i16` sums of 16 quants.
    pub(crate) const Q8K_BYTES: usize = 292;
    /// Bytes of a `Q4_K` super-block: `f16 d, dmin`, 12 bytes of packed 6-bit scales and mins,
    /// 128 bytes of 4-bit quants.
    pub(crate) const Q4K_BYTES: usize = 144;
    /// Bytes of a `Q6_K` super-block: 128 bytes of low 4 bits, 64 of high 2 bits, 16 `i8`
    /// scales, `f16 d`.
    pub(crate) const Q6K_BYTES: usize = 210;
}
pub(crate) use ksize::{Q4K_BYTES, Q6K_BYTES, Q8K_BYTES, QK_K};

// The kernels of each architecture live in its own folder; `#[path]` keeps them child modules
// of this one (they use its private types).
#[cfg(target_arch = "x86_64")]
#[path = "x86_64/kquant.rs"]
pub(crate) mod kquant;
#[cfg(target_arch = "aarch64")]
#[path = "aarch64/qdot.rs"]
mod neon;
#[cfg(target_arch = "aarch64")]
#[path = "aarch64/kquant.rs"]
mod neon_k;
#[cfg(target_arch = "x86_64")]
#[path = "x86_64/qdot.rs"]
mod x86;

/// How far ahead of the weight block being read the x86-64 kernels (k-quants too) ask for the
/// weights, in bytes: each block's loop prefetches the lines this far on, so a matrix streamed
/// from DRAM (a projection many times the caches) arrives before it is needed. On the AMD EPYC
/// (Zen 5) VM the hardware prefetchers alone left the 512-bit two-row kernel waiting on
/// memory: Gemma 3's 262144 x 640 `Q8_0` projection, one thread's half, went 10.2 -> 1.9 ms at
/// one row and 17.7 -> 5.7 ms at eight (4 KB ahead: 3.8 and 6.2 ms; 8 KB: 2.5 and 6.2; 32 KB:
/// as 16 KB; the kernels bench's `stream/` group times it). `leap profile` there:
/// `docs/measurements.md`, "Prefetched weights, softmax and cache writes on the device". The
/// NEON kernels do not prefetch yet; emulated ARM gives no timing to tune it by.
#[cfg(target_arch = "x86_64")]
pub(crate) const AHEAD: usize = 16384;

/// Rows per pass over a weight block: enough to amortise the unpacking, few enough to keep
/// every accumulator in a register.
const GROUP: usize = 4;

/// The fewest activation rows for which `Q8_0` takes the AVX-512 kernel. Its 8-bit weights
/// need no unpacking, so at one or two rows the 512-bit pass has nothing to amortise and loses
/// to the 256-bit VNNI one; from three rows on it wins. Gemma 3's output projection (262144 x
/// 640 `Q8_0`), 2 threads, median of 11 rounds on the AVX-512 Xeon VM: 1 row 14.3-14.5 ms
/// against 13.2-13.4, 3 rows 16.9-17.1 against 17.4-17.6, 8 rows 25.1-25.3 against 33.5-33.7.
/// (`variant` names it.)
#[cfg(target_arch = "x86_64")]
const Q8_0_ZMM_FROM: usize = 3;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(Q8_0_ZMM_FROM == 3, "Kernel::variant names the threshold");

/// Calls `f(activation rows, weight row, outputs)` for every weight row of `w` (`nb`
/// super-blocks of `block` bytes) and every group of up to `G` activation rows: the
/// k-quant kernels' driver on every architecture (inlined into each one's `target_feature`
/// function, so that `f`'s kernel is too).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn by_groups<const G: usize>(
    rows: &[&[u8]],
    nb: usize,
    w: &[u8],
    block: usize,
    out: &mut [f32],
    f: impl Fn(&[*const u8], *const u8, &mut [f32]),
) {
    let m = rows.len();
    for g0 in (0..m).step_by(G) {
        let gl = (m - g0).min(G);
        let ptrs: [*const u8; G] =
            std::array::from_fn(|r| rows.get(g0 + r).map_or(std::ptr::null(), |a| a.as_ptr()));
        for (i, x) in w.chunks_exact(nb * block).enumerate() {
            f(
                &ptrs[..gl],
                x.as_ptr(),
                &mut out[i * m + g0..i * m + g0 + gl],
            );
        }
    }
}

/// Rows per pass of the 256-bit x86 kernels for the 32-weight blocks: a weight block is
/// unpacked once for up to eight rows (`Q5_0`'s unpacking is about two rows' products), where
/// [`GROUP`]'s four made an 8-row call two passes over each weight row. On the AVX2-only AMD
/// EPYC VM (Zen 4, AVX-512 hidden) `leap profile -m gemma3-270m --paths engine --rows 1,8
/// --reps 15` (Leap's build of llama.cpp) put Gemma 3's 8-row call (the call cut before the
/// projection, then the projection) at 43.7-68.1 ms against 70.8-84.9 ms with four
/// (`3d873c4`), three alternating runs each (`docs/measurements.md`, "Eight rows a pass on
/// AVX2").
#[cfg(target_arch = "x86_64")]
const WIDE: usize = 8;

/// `v` (row-major, `rows` rows of `nb` blocks) by groups of `by` rows: row r's block b at
/// `(r / by * nb + b) * by + r % by`, zeros past the last row; empty for an empty `v`.
#[cfg(target_arch = "x86_64")]
fn by_row_groups(v: &[f32], rows: usize, nb: usize, by: usize) -> Vec<f32> {
    if v.is_empty() {
        return Vec::new();
    }
    let mut out = vec![0.0f32; rows.div_ceil(by) * nb * by];
    for r in 0..rows {
        for b in 0..nb {
            out[(r / by * nb + b) * by + r % by] = v[r * nb + b];
        }
    }
    out
}

/// A checked-available kernel for one weight type.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    kind: Kind,
    /// AVX-512 VNNI (`vpdpbusd`): the same integer lane sums in one instruction.
    vnni: bool,
    /// AVX-512 registers (with VNNI): two weight rows' lanes in each for the 32-weight
    /// blocks, a sub-block pair's 64 quants in each for the k-quants.
    zmm: bool,
    /// The fewest activation rows a call takes the AVX-512 path for (fewer take the 256-bit
    /// one; see [`Kernel::new`]).
    zmm_from: usize,
    /// AArch64: the integer sums with `sdot` (FEAT_DotProd) instead of `smull` + `sadalp`;
    /// the same integers.
    sdot: bool,
    /// AArch64: the integer sums with `smmla` (FEAT_I8MM) where a kernel has such a path; the
    /// same integers.
    i8mm: bool,
    /// AArch64: the ggml this kernel must match was built with dotprod, so its 32-weight blocks
    /// sum bytes 4l..4l+3 into lane l (`vdotq_s32`); without, ggml's `ggml_vdotq_s32` sums
    /// bytes 2l, 2l+1, 2l+8, 2l+9 (Leap's own build of ggml is armv8-a: without).
    #[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
    ggml_dotprod: bool,
}

/// Activation rows prepared for [`Kernel::dot_many`]: the rows and their block scales as `f32`.
pub struct Acts<'a> {
    rows: Vec<&'a [u8]>,
    /// `scales[r * nb + b]`: row r's block b scale.
    scales: Vec<f32>,
    /// For the AVX-512 kernels: row r's 32 quants of block b at `(r * nb + b) * 32`, plus 128
    /// (as unsigned) for `Q8_0`.
    qs: Vec<u8>,
    /// For the AVX-512 `Q5_0` kernel (which takes the weights plus 128): -128 times the sum of
    /// each 4 quants of `qs` (each of `vpdpbusd`'s integer lanes), row r's block b's eight at
    /// `(r * nb + b) * 8`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    lane_sums: Vec<i32>,
    /// `Q8_1`'s block sums as `f32` (`Q4_1` only), indexed like `scales`.
    sums: Vec<f32>,
    /// For the 256-bit x86 kernels of the 32-weight blocks, by groups of [`WIDE`] rows (group
    /// g holds rows `g * WIDE..`): row r's block b scale at `(g * nb + b) * WIDE + r % WIDE`,
    /// zero past the last row, so that one 8-lane product with the weight's scale makes a
    /// block's scale products for a group's rows.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    wide_scales: Vec<f32>,
    /// Also for them (`Q4_1`): the block sums by groups of [`WIDE`] rows, row r's block b at
    /// `(g * nb + b) * WIDE + r % WIDE`, zero past the last row, so that one 8-lane fused
    /// multiply-add does a block's `m * s` for a group's rows.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    block_sums: Vec<f32>,
    /// For the AVX-512 `Q4_1` kernel (empty where a call does not take it): the block sums by
    /// groups of [`GROUP`] rows, row r's block b at `(g * nb + b) * GROUP + r % GROUP`, zero
    /// past the last row, so that one 4-lane fused multiply-add does a block's `m * s` for
    /// four rows.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    group_sums: Vec<f32>,
    nb: usize,
}

impl Acts<'_> {
    /// Rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// No rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

impl Kernel {
    /// The kernel for `kind` when this CPU can run it: x86-64 with AVX2, FMA and F16C (VNNI
    /// and AVX-512 where present), or any AArch64 CPU (NEON; dotprod and i8mm where present).
    pub fn new(kind: Kind) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                let vnni = std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::arch::is_x86_feature_detected!("avx512vl");
                let zmm = vnni
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw");
                return Some(Self {
                    kind,
                    vnni,
                    zmm,
                    zmm_from: if kind == Kind::Q8_0 { Q8_0_ZMM_FROM } else { 1 },
                    sdot: false,
                    i8mm: false,
                    ggml_dotprod: false,
                });
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            // NEON is the AArch64 baseline (armv8.0-a); dotprod and i8mm where the CPU has them.
            return Some(Self {
                kind,
                vnni: false,
                zmm: false,
                zmm_from: 1,
                sdot: std::arch::is_aarch64_feature_detected!("dotprod"),
                i8mm: std::arch::is_aarch64_feature_detected!("i8mm"),
                ggml_dotprod: false,
            });
        }
        #[allow(unreachable_code)]
        {
            let _ = kind;
            None
        }
    }

    /// The same kernel without `sdot` and `smmla` (plain NEON): for comparing them.
    pub fn without_dotprod(self) -> Self {
        Self {
            sdot: false,
            i8mm: false,
            ..self
        }
    }

    /// The same kernel without `smmla`: for comparing them.
    pub fn without_i8mm(self) -> Self {
        Self {
            i8mm: false,
            ..self
        }
    }

    /// The same kernel for a ggml built with (`true`) or without dotprod (see the field).
    pub fn for_ggml_dotprod(self, on: bool) -> Self {
        Self {
            ggml_dotprod: on,
            ..self
        }
    }

    /// Which instructions this kernel runs (for `-v` and tests): e.g. `neon+sdot`.
    pub fn variant(&self) -> &'static str {
        match (self.zmm, self.vnni, self.sdot, self.i8mm) {
            (true, _, _, _) if self.zmm_from > 1 => "avx512-from-3-rows",
            (true, _, _, _) => "avx512",
            (_, true, _, _) => "avx2+vnni",
            (_, _, _, true) if cfg!(target_arch = "aarch64") => "neon+i8mm",
            (_, _, true, _) => "neon+sdot",
            _ if cfg!(target_arch = "aarch64") => "neon",
            _ => "avx2",
        }
    }

    /// The same kernel without AVX-512 VNNI (nor AVX-512 registers): for comparing them.
    pub fn without_vnni(self) -> Self {
        Self {
            vnni: false,
            zmm: false,
            ..self
        }
    }

    /// The same kernel on 256-bit registers only: for comparing them.
    pub fn without_zmm(self) -> Self {
        Self { zmm: false, ..self }
    }

    /// The same kernel on AVX-512 registers where this CPU has them, for any number of rows
    /// (also `Q8_0`'s one and two, which [`Kernel::new`] keeps off them): for comparing them.
    pub fn with_zmm(self) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let zmm = self.vnni
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw");
            Self {
                zmm,
                zmm_from: 1,
                ..self
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        self
    }

    /// Whether a call of `rows` activation rows takes the AVX-512 path.
    fn wide(&self, rows: usize) -> bool {
        self.zmm && rows >= self.zmm_from
    }

    /// The weight type.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Check `acts` (rows of `n` values of the activation type) and convert their scales.
    ///
    /// # Panics
    /// When `n` is not a multiple of 32 or a row is shorter than `n` needs.
    pub fn prepare<'a>(&self, n: usize, acts: &[&'a [u8]]) -> Acts<'a> {
        if self.kind.is_k() {
            assert_eq!(n % QK_K, 0, "row length not a multiple of 256");
            let nb = n / QK_K;
            for a in acts {
                assert!(a.len() >= nb * Q8K_BYTES, "activation row too short");
            }
            return Acts {
                rows: acts.to_vec(),
                scales: Vec::new(),
                qs: Vec::new(),
                lane_sums: Vec::new(),
                sums: Vec::new(),
                wide_scales: Vec::new(),
                block_sums: Vec::new(),
                group_sums: Vec::new(),
                nb,
            };
        }
        assert_eq!(n % 32, 0, "row length not a multiple of 32");
        let (nb, ab) = (n / 32, self.kind.act_block());
        // A call of a few rows prepares its activations once per weight matrix (hundreds of
        // times a model call), so nothing here goes an element at a time where a block's
        // bytes can be copied whole.
        let wide = self.wide(acts.len());
        let q4_1 = self.kind == Kind::Q4_1;
        let mut scales = Vec::with_capacity(acts.len() * nb);
        let mut qs = Vec::with_capacity(if wide { acts.len() * nb * 32 } else { 0 });
        let mut sums = Vec::with_capacity(if q4_1 { acts.len() * nb } else { 0 });
        let f16 = |a: &[u8], at: usize| crate::f16::to_f32(u16::from_le_bytes([a[at], a[at + 1]]));
        // Where a block's 32 quants start (after d, and s for Q8_1).
        let q_at = ab - 32;
        for a in acts {
            assert!(a.len() >= nb * ab, "activation row too short");
            for block in a[..nb * ab].chunks_exact(ab) {
                scales.push(f16(block, 0));
                // `Q8_1`'s block sums as `f32`, converted once here rather than per weight row.
                if q4_1 {
                    sums.push(f16(block, 2));
                }
                if wide {
                    qs.extend_from_slice(&block[q_at..]);
                }
            }
            // NEON: the quants permuted where the kernel's integer lanes differ from the
            // ggml's it matches (see `aarch64/qdot.rs`).
            #[cfg(target_arch = "aarch64")]
            if let Some(p) = neon::permutation(self) {
                for b in 0..nb {
                    let q = &a[b * ab + q_at..(b + 1) * ab];
                    qs.extend(
                        q.chunks_exact(16)
                            .flat_map(|h| p.map(|i| h[usize::from(i)])),
                    );
                }
            }
        }
        // The AVX-512 kernels take `Q8_0`'s activations plus 128 (as unsigned), and for
        // `Q5_0`'s weights plus 128 what that adds: -128 times the activations' lane sums.
        let lane_sums = if wide && self.kind == Kind::Q5_0 {
            qs.chunks_exact(4)
                .map(|l| -128 * l.iter().map(|&q| i32::from(q as i8)).sum::<i32>())
                .collect()
        } else {
            Vec::new()
        };
        if wide && self.kind == Kind::Q8_0 {
            qs.iter_mut().for_each(|q| *q ^= 0x80);
        }
        // The 256-bit kernels' layouts (the AVX-512 kernels take a last odd weight row with
        // them too), and the AVX-512 `Q4_1` kernel's.
        #[cfg(target_arch = "x86_64")]
        let (wide_scales, block_sums, group_sums) = {
            let rows = acts.len();
            (
                by_row_groups(&scales, rows, nb, WIDE),
                by_row_groups(&sums, rows, nb, WIDE),
                if wide {
                    by_row_groups(&sums, rows, nb, GROUP)
                } else {
                    Vec::new()
                },
            )
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (wide_scales, block_sums, group_sums) = (Vec::new(), Vec::new(), Vec::new());
        Acts {
            rows: acts.to_vec(),
            scales,
            qs,
            lane_sums,
            sums,
            wide_scales,
            block_sums,
            group_sums,
            nb,
        }
    }

    /// Dot products of every weight row in `w` (consecutive rows of `acts`' length) with every
    /// activation row: `out[i * acts.len() + r]` for weight row i and activation row r.
    ///
    /// # Panics
    /// When `w` is not whole rows or `out` has the wrong length.
    pub fn dot_many(&self, acts: &Acts<'_>, w: &[u8], out: &mut [f32]) {
        let row = acts.nb * self.kind.weight_block();
        assert!(
            row > 0 && w.len().is_multiple_of(row),
            "not whole weight rows"
        );
        assert_eq!(out.len(), w.len() / row * acts.len());
        if acts.is_empty() {
            return;
        }
        #[cfg(target_arch = "aarch64")]
        // SAFETY: `new` checked the CPU features; lengths checked above and in `prepare`.
        unsafe {
            match self.kind {
                Kind::Q4K => neon_k::q4k(self, &acts.rows, acts.nb, w, out),
                Kind::Q6K => neon_k::q6k(self, &acts.rows, acts.nb, w, out),
                _ => neon::many(self, acts, w, out),
            }
        };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `new` checked the CPU features; lengths checked above and in `prepare`.
        unsafe {
            if self.kind == Kind::Q4K && self.zmm {
                kquant::zmm::q4k(&acts.rows, acts.nb, w, out)
            } else if self.kind == Kind::Q4K {
                kquant::q4k(&acts.rows, acts.nb, w, out)
            } else if self.kind == Kind::Q6K && self.zmm {
                kquant::zmm::q6k(&acts.rows, acts.nb, w, out)
            } else if self.kind == Kind::Q6K {
                kquant::q6k(&acts.rows, acts.nb, w, out)
            } else if self.wide(acts.len()) {
                x86::zmm::many(self.kind, acts, w, out)
            } else if self.vnni {
                x86::vnni::many(self.kind, acts, w, out)
            } else {
                x86::avx2::many(self.kind, acts, w, out)
            }
        };
    }

    /// Whether [`Kernel::dot_many_repacked`] runs here: a `Q4_K` kernel on x86-64 (where
    /// llama.cpp repacks `Q4_K` weights, on CPUs with AVX2).
    pub fn has_repacked(&self) -> bool {
        cfg!(target_arch = "x86_64") && self.kind == Kind::Q4K
    }

    /// As [`Kernel::dot_many`] for `Q4_K` weights llama.cpp repacked, read in ggml's repacked
    /// layout (`w`: whole groups of 8 weight rows, each `nb` `block_q4_Kx8`s, see
    /// [`Q4K_X8_BYTES`]), each result rounded as ggml's one-row product over them rounds it
    /// ([`crate::reference::q4k_repacked`] of the row in `Q4_K`'s own layout). ggml computes
    /// batches of four rows and more over repacked weights otherwise (its 4-row product
    /// accumulates in another order), so a row of a batch gets other bits than the row alone;
    /// this gives every row the lone row's.
    ///
    /// # Panics
    /// When [`Kernel::has_repacked`] is false, `w` is not whole 8-row groups, or as
    /// [`Kernel::dot_many`].
    pub fn dot_many_repacked(&self, acts: &Acts<'_>, w: &[u8], out: &mut [f32]) {
        assert!(self.has_repacked(), "no repacked-Q4_K kernel here");
        let group = acts.nb * Q4K_X8_BYTES;
        assert!(
            group > 0 && w.len().is_multiple_of(group),
            "not whole 8-row groups"
        );
        assert_eq!(out.len(), w.len() / group * 8 * acts.len());
        if acts.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `new` checked AVX2, FMA and F16C; lengths checked above and in `prepare`.
        unsafe {
            kquant::q4k_x8(&acts.rows, acts.nb, w, out)
        }
    }

    /// Whether this kernel reproduces `reference` (ggml's single-row `vec_dot`) bit for bit on
    /// every weight row of `weights` against every row of `acts` (made by the caller with
    /// ggml's own quantizers), computed together.
    pub fn agrees(
        &self,
        n: usize,
        weights: &[u8],
        acts: &[&[u8]],
        mut reference: impl FnMut(&[u8], &[u8]) -> f32,
    ) -> bool {
        let row = n / self.kind.block_len() * self.kind.weight_block();
        let a = self.prepare(n, acts);
        let mut out = vec![0.0f32; weights.len() / row * acts.len()];
        self.dot_many(
            &a,
            &weights[..out.len() / acts.len().max(1) * row],
            &mut out,
        );
        weights
            .chunks_exact(row)
            .zip(out.chunks_exact(acts.len().max(1)))
            .all(|(w, o)| {
                acts.iter()
                    .zip(o)
                    .all(|(a, o)| reference(w, a).to_bits() == o.to_bits())
            })
    }
}

/// Bytes of ggml's `block_q4_Kx8`: eight `Q4_K` super-blocks of eight consecutive weight rows,
/// interleaved (`d[8]`, `dmin[8]`, 96 bytes of scales and mins, 1024 of quants in chunks of 8
/// bytes, row j's bytes 8c..8c + 8 at chunk 8c + j). llama.cpp's repacking
/// (`repack_q4_K_to_q4_K_8_bl`) writes, for each 8 rows, one per super-block.
pub const Q4K_X8_BYTES: usize = 8 * Q4K_BYTES;
