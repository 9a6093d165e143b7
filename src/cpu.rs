//! CPU kernel selection for the `blas` feature.
//!
//! OpenBLAS built with `DYNAMIC_ARCH` (Debian's, among others) picks its kernels from the
//! CPU model number when the library loads. A model it was released before (Emerald Rapids,
//! model 0xCF, under OpenBLAS 0.3.21) falls back to the generic `Prescott` kernels: SSE3,
//! 26 GFLOP/s for an SGEMM on two cores where the AVX-512 `SkylakeX` kernels reach 149
//! (BENCHMARKS.md). The choice is made in the library's constructor, before `main`, and
//! read from `OPENBLAS_CORETYPE`, so the fix is to set that variable and start the program
//! again: [`select_blas_kernels`] does so, once, when the library fell back although the CPU
//! has the instructions of a better kernel set. A `OPENBLAS_CORETYPE` the user set is never
//! overridden.

/// Call first in `main`, before any thread starts. On a misdetected CPU this replaces the
/// process (same pid, arguments and environment, plus `OPENBLAS_CORETYPE`); otherwise, and
/// without the `blas` feature, it returns at once.
pub fn select_blas_kernels() {
    #[cfg(all(feature = "blas", target_os = "linux", target_arch = "x86_64"))]
    imp::select();
}

/// The kernel set OpenBLAS runs, e.g. `SkylakeX`; `None` without the `blas` feature.
pub fn blas_core() -> Option<String> {
    #[cfg(all(feature = "blas", target_os = "linux", target_arch = "x86_64"))]
    {
        Some(imp::core_name())
    }
    #[cfg(not(all(feature = "blas", target_os = "linux", target_arch = "x86_64")))]
    {
        None
    }
}

/// mimalloc's `mi_option_purge_delay`: its place in the option enum of mimalloc 3, the
/// version the `mimalloc` crate builds (checked by a test against the option's default).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

// Linked by the `mimalloc` crate (libmimalloc-sys), the binary's global allocator; the
// library names the crate so that every binary built on it links the C library.
use mimalloc as _;
unsafe extern "C" {
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
    fn mi_option_get(option: std::ffi::c_int) -> std::ffi::c_long;
}

/// Stops the allocator handing freed memory back to the kernel (mimalloc's purge delay set
/// to never), once per process (`train.keep_freed_memory`). mimalloc purges every free
/// span of an arena when its delay (a second) runs out, including spans freed a moment
/// before, so a step's buffers keep coming back as fresh pages to fault in and zero.
/// Without a mimalloc global allocator (the tests') it sets an option nothing reads.
pub fn keep_freed_memory() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: setting an option is a store mimalloc reads at its next purge decision.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
        tracing::info!("keeping freed memory for the next step (allocator purging off)");
    });
}

/// mimalloc's purge delay in milliseconds (-1: never).
pub fn purge_delay_ms() -> std::ffi::c_long {
    // SAFETY: reading an option; mimalloc reads its environment variable on first use.
    unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) }
}

/// The best OpenBLAS kernel set whose instructions this CPU has, judged from the CPU's
/// feature flags (not its model number), or `None` where nothing beats the generic kernels
/// or the CPU is not x86-64.
pub fn best_blas_core() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512cd");
        if avx512 && std::arch::is_x86_feature_detected!("avx512bf16") {
            Some("Cooperlake")
        } else if avx512 {
            Some("SkylakeX")
        } else if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            Some("Haswell")
        } else {
            None
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

#[cfg(all(feature = "blas", target_os = "linux", target_arch = "x86_64"))]
mod imp {
    use std::os::unix::process::CommandExt;

    // Linked by burn's `openblas-system` (blas-src → openblas-src).
    unsafe extern "C" {
        fn openblas_get_corename() -> *const std::ffi::c_char;
    }

    pub(super) fn core_name() -> String {
        // SAFETY: OpenBLAS returns a pointer to a static NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(openblas_get_corename()) }
            .to_string_lossy()
            .into_owned()
    }

    /// The generic kernel sets OpenBLAS falls back to for a CPU model it does not know.
    fn is_fallback(core: &str) -> bool {
        matches!(
            core.to_ascii_lowercase().as_str(),
            "prescott" | "core2" | "nehalem"
        )
    }

    pub(super) fn select() {
        if std::env::var_os("OPENBLAS_CORETYPE").is_some() {
            return;
        }
        let core = core_name();
        let Some(best) = super::best_blas_core() else {
            return;
        };
        if !is_fallback(&core) {
            return;
        }
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let mut args = std::env::args_os();
        let argv0 = args.next();
        let mut cmd = std::process::Command::new(exe);
        if let Some(argv0) = argv0 {
            cmd.arg0(argv0);
        }
        let err = cmd.args(args).env("OPENBLAS_CORETYPE", best).exec();
        // Only reached when exec failed: carry on with the slow kernels, and say so.
        eprintln!(
            "warning: OpenBLAS chose its generic {core} kernels for this CPU and restarting \
             with OPENBLAS_CORETYPE={best} failed ({err}); matrix products will be slow. \
             Set OPENBLAS_CORETYPE={best} yourself to fix it."
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_purge_delay_option_is_mimallocs() {
        // mimalloc 3's default for `purge_delay` (1000 ms); another option at this place in
        // the enum would read otherwise. The variable overrides the default.
        let expected = std::env::var("MIMALLOC_PURGE_DELAY")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000);
        assert_eq!(super::purge_delay_ms(), expected);
    }
}
