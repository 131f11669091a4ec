//! The instruction-set baseline a build was compiled for, checked against the running CPU, so
//! that a CPU below it gets a sentence instead of SIGILL in the first kernel.

/// The first feature this build was compiled to assume (its `target-feature`s: the x86-64
/// build names AVX2, FMA, F16C and BMI2 in `.cargo/config.toml`; an aarch64 build assumes NEON,
/// and more when built with a higher `target-cpu`) that this CPU lacks, if any.
pub fn missing_baseline() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! need {
            ($($f:tt),*) => {$(
                if cfg!(target_feature = $f) && !std::arch::is_x86_feature_detected!($f) {
                    return Some($f);
                }
            )*};
        }
        need!("sse4.2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl");
    }
    #[cfg(target_arch = "aarch64")]
    {
        macro_rules! need {
            ($($f:tt),*) => {$(
                if cfg!(target_feature = $f) && !std::arch::is_aarch64_feature_detected!($f) {
                    return Some($f);
                }
            )*};
        }
        need!("neon", "fp16", "dotprod", "i8mm", "sve", "sve2");
    }
    None
}

/// One line for a user whose CPU lacks `feature`, which this build was compiled for.
pub fn below_baseline_message(feature: &str) -> String {
    format!(
        "this CPU lacks {feature}, which this build of Leap was compiled for ({arch}); \
         build for this CPU (see the README's build notes) or run on a newer one",
        arch = std::env::consts::ARCH
    )
}

#[cfg(test)]
mod tests {
    /// The machine that runs the tests is the one the build was made for (CI's, a
    /// developer's, or an emulated core that has the build's features), so nothing is missing;
    /// the message names the feature.
    #[test]
    fn the_running_cpu_has_the_baseline() {
        assert_eq!(super::missing_baseline(), None);
        assert!(super::below_baseline_message("dotprod").contains("lacks dotprod"));
    }
}
