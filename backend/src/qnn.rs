//! Sparse attention's estimate on Qualcomm's NPU through QNN (feature `qnn`, [`leap_ggml_qnn`]).
//!
//! No device of its own: the attention stays with the device that takes it (`leap-cpu`),
//! whose estimate step asks QNN for the scores of a (query row, KV head) against all its
//! candidate keys in one launch ([`leap_ggml_qnn::estimate`]: per-row scales, one graph per
//! padded key count), then selects, re-ranks and attends exactly as with the CPU estimate.
//! Nothing changes for the user: when the library loads, it is used; when it does not, a
//! warning says why and the CPU estimates.
//!
//! When it is used ([`Sparse::qnn`](crate::attn::Sparse::qnn) `None`, the default):
//! - Android (`target_os = "android"`): whenever `libQnnHtp.so` loads. That is the NPU.
//! - elsewhere, only with `LEAP_QNN=on`: off a phone the library is Qualcomm's x86 HTP
//!   emulator, which computes on the same cores as the CPU estimate, much more slowly (it is
//!   there to test the path, not to speed anything up).
//!
//! `LEAP_QNN=off` turns it off everywhere. The libraries are found as `leap qnn-selftest`
//! finds them (`LEAP_QNN_LIB_DIR`, then the cache `scripts/fetch-qnn` fills).

use std::sync::OnceLock;

#[cfg(feature = "qnn")]
use leap_ggml_qnn::estimate::Estimator;

/// The environment variable: `on` or `off` (default: on for Android, off elsewhere).
pub const ENV: &str = "LEAP_QNN";

/// Whether QNN is wanted when the settings do not say: `LEAP_QNN` (read once), else the
/// platform's default.
pub fn wanted_by_default() -> bool {
    static WANTED: OnceLock<bool> = OnceLock::new();
    *WANTED.get_or_init(|| match std::env::var(ENV).as_deref().map(str::trim) {
        Ok("on") | Ok("1") | Ok("true") => true,
        Ok("off") | Ok("0") | Ok("false") => false,
        Ok("") | Err(_) => cfg!(target_os = "android"),
        Ok(v) => {
            log::warn!("{ENV} must be on or off, not {v:?}; using the default");
            cfg!(target_os = "android")
        }
    })
}

#[cfg(feature = "qnn")]
static EST: OnceLock<Result<Estimator, String>> = OnceLock::new();

/// The process's QNN estimator, made on first use; the error says why there is none (logged
/// once, as a warning, when it happens).
#[cfg(feature = "qnn")]
pub fn estimator() -> Result<&'static Estimator, &'static str> {
    EST.get_or_init(|| {
        let made = leap_ggml_qnn::Api::load(None).and_then(|api| {
            let what = format!(
                "{} (core API {}) at {}",
                api.provider,
                api.core_api,
                api.path.display()
            );
            Estimator::open(api).map(|e| (e, what))
        });
        match made {
            Ok((e, what)) => {
                log::info!("sparse attention's estimate runs on QNN: {what}");
                Ok(e)
            }
            Err(e) => {
                log::warn!(
                    "QNN unavailable, sparse attention estimates on the CPU: {e} \
                     (set {ENV}=off to not try)"
                );
                Err(e.to_string())
            }
        }
    })
    .as_ref()
    .map_err(String::as_str)
}

/// Why QNN is not available (`None` if it is, or was never tried).
pub fn unavailable_reason() -> Option<String> {
    #[cfg(feature = "qnn")]
    {
        EST.get()?.as_ref().err().cloned()
    }
    #[cfg(not(feature = "qnn"))]
    {
        Some("built without the qnn feature".into())
    }
}

/// Whether the estimate runs on QNN for `choice` (`Sparse::qnn`): forced on or off, or the
/// default; loads the library the first time it is wanted.
pub fn use_for(choice: Option<bool>) -> bool {
    if !choice.unwrap_or_else(wanted_by_default) {
        return false;
    }
    #[cfg(feature = "qnn")]
    {
        estimator().is_ok()
    }
    #[cfg(not(feature = "qnn"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| log::warn!("QNN asked for, but Leap was built without the qnn feature"));
        false
    }
}

/// QNN graph executions of the estimate so far (0 without the library; never loads it).
pub fn executes() -> u64 {
    #[cfg(feature = "qnn")]
    {
        EST.get()
            .and_then(|e| e.as_ref().ok())
            .map_or(0, Estimator::executes)
    }
    #[cfg(not(feature = "qnn"))]
    {
        0
    }
}

/// Scores of `g` f32 query rows (`q`, rows of `d`) against `n` keys fetched by `key(j)` (f16
/// rows of `d`), written to `out[x][..n]`.
///
/// # Errors
/// No QNN here, or a QNN failure (the caller estimates on the CPU instead).
///
/// # Safety
/// Every `key(j)`, `j < n`, points to `d` readable f16 values.
pub unsafe fn scores(
    q: &[f32],
    (g, d, n): (usize, usize, usize),
    key: impl Fn(usize) -> *const u16,
    out: &mut [&mut [f32]],
) -> Result<(), String> {
    #[cfg(feature = "qnn")]
    {
        let est = estimator()?;
        let mut k = vec![0f32; n * d];
        for (j, row) in k.chunks_exact_mut(d).enumerate() {
            let p = key(j);
            for (c, v) in row.iter_mut().enumerate() {
                *v = crate::f16::to_f32(*p.add(c));
            }
        }
        let mut s = vec![0f32; g * n];
        est.scores(&q[..g * d], &k, (1, g, n, d), &mut s)
            .map_err(|e| e.to_string())?;
        for (o, row) in out.iter_mut().zip(s.chunks_exact(n)) {
            o[..n].copy_from_slice(row);
        }
        Ok(())
    }
    #[cfg(not(feature = "qnn"))]
    {
        let _ = (q, g, d, n, key, out);
        Err("built without the qnn feature".into())
    }
}
