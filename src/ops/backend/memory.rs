//! How the process's allocator treats the large buffers a CPU training step frees.
//!
//! A training step on the CPU allocates its large tensors afresh every step (Burn owns them once
//! an op returns them) and frees them at its end. glibc's `malloc` hands a freed block at the top
//! of its heap back to the operating system once more than its trim threshold is free there (by
//! default twice the largest block it has mapped on its own, at most 64 MiB), and maps blocks
//! above its mmap threshold on their own, unmapping them when freed. Either way the next step's
//! buffers arrive as new pages, which the kernel zeroes and faults in one by one on first touch.
//! [`retain_freed_memory`] turns that off for the whole process.

/// Keeps the memory that the process frees for its next allocations instead of returning it to
/// the operating system: with glibc (Linux), the allocator's trim threshold is raised to its
/// maximum (2 GiB) and no block is mapped on its own. Returns whether the settings were applied:
/// `false` where the C library is not glibc (musl, macOS, Windows), whose allocators behave
/// otherwise.
///
/// Opt in from a CPU training or generation program (the crate's examples do): it changes the
/// allocator of the whole process, and its resident memory then stays at its peak instead of
/// shrinking between steps. Where a program has chosen another global allocator (mimalloc,
/// jemalloc), this changes nothing for the memory that allocator manages. The environment gives
/// the same without code: `GLIBC_TUNABLES=glibc.malloc.trim_threshold=2147483647:glibc.malloc.mmap_max=0`.
///
/// What it buys on this project's 2-core machine (BENCHMARKS, "Freed memory kept in the
/// process"): `chunk_kda` forward + backward at T = 8192, each call of which frees about 70 MiB,
/// about a tenth faster (glibc had returned about 16 MiB per call to the kernel), and linear in T
/// again; the default `train_tiny` run, whose buffers are smaller, about 2% (within its spread).
/// glibc gives each thread that allocates concurrently an arena of its own, and those still unmap
/// a heap of theirs that a step frees completely: `MALLOC_ARENA_MAX=1` in the environment keeps
/// every thread on the one heap (`train_tiny`: from about 1950 page faults per step to 65).
///
/// Safe to call more than once and from any thread; the settings are applied once.
///
/// ```
/// // At the start of a CPU training program:
/// let kept = kimi_burn::ops::backend::retain_freed_memory();
/// assert_eq!(kept, cfg!(all(target_os = "linux", target_env = "gnu")));
/// ```
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static APPLIED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *APPLIED.get_or_init(|| {
            // SAFETY: `mallopt` only changes the allocator's parameters; glibc takes its own
            // locks. Each returns 1 on success.
            let (trim, mmap) = unsafe {
                (
                    libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX),
                    libc::mallopt(libc::M_MMAP_MAX, 0),
                )
            };
            trim == 1 && mmap == 1
        })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// Minor page faults of this thread so far.
    fn faults() -> i64 {
        // SAFETY: `getrusage` writes the struct it is given.
        unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut usage), 0);
            usage.ru_minflt
        }
    }

    /// Three 12 MiB buffers allocated, written and freed again, `cycles` times; the faults of
    /// all but the first cycle.
    fn churn(cycles: usize) -> i64 {
        let mut before = 0;
        for cycle in 0..cycles {
            if cycle == 1 {
                before = faults();
            }
            let bufs: Vec<Vec<u8>> = (0..3)
                .map(|i| {
                    let mut v = Vec::with_capacity(12 << 20);
                    v.resize(12 << 20, i as u8 + 1);
                    v
                })
                .collect();
            std::hint::black_box(&bufs);
        }
        faults() - before
    }

    /// With glibc's defaults the 36 MiB freed at the top of the heap (three times the 12 MiB
    /// threshold its own mapping of the first buffer set) go back to the kernel every cycle, and
    /// the next cycle faults in all 9216 of their pages again (checked: this test fails without
    /// the call). Kept, the later cycles reuse the same pages.
    #[test]
    fn freed_buffers_come_back_without_page_faults() {
        assert!(retain_freed_memory());
        assert!(retain_freed_memory(), "a second call reports the same");
        let pages = 3 * (12 << 20) / 4096;
        let faulted = churn(6);
        // Five cycles after the first; other test threads may take some of the freed memory.
        assert!(
            faulted < pages as i64,
            "{faulted} page faults in five cycles of {pages} pages each"
        );
    }
}
