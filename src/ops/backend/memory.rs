//! How the process's allocator treats the large buffers a CPU training step frees.
//!
//! A training step on the CPU allocates its large tensors afresh every step (Burn owns them once
//! an op returns them) and frees them at its end. glibc's `malloc` hands a freed block at the top
//! of its heap back to the operating system once more than its trim threshold is free there (by
//! default twice the largest block it has mapped on its own, at most 64 MiB), and maps blocks
//! above its mmap threshold on their own, unmapping them when freed; and a thread that allocates
//! while others do gets an arena of its own, which hands back the same way, and whose heaps
//! beyond its first (64 MiB each) are unmapped as soon as a step frees one whole. Each way the
//! next step's buffers arrive as new pages, which the kernel zeroes and faults in one by one on
//! first touch. [`retain_freed_memory`] turns the first two off for the whole process.

/// Keeps the memory that the process frees for its next allocations instead of returning it to
/// the operating system: with glibc (Linux), the allocator's trim threshold goes to its maximum
/// (2 GiB) and no block is mapped on its own. Returns whether the settings were applied: `false`
/// where the C library is not glibc (musl, macOS, Windows), whose allocators behave otherwise.
///
/// Opt in at the start of a CPU training or generation program (the crate's examples do): it
/// changes the allocator of the whole process, whose resident memory then stays at its peak
/// instead of shrinking between steps. Where a program has chosen another global allocator
/// (mimalloc, jemalloc), it changes nothing for the memory that allocator manages. The
/// environment gives the same without code:
/// `GLIBC_TUNABLES=glibc.malloc.trim_threshold=2147483647:glibc.malloc.mmap_max=0`.
///
/// Threads keep their own arenas. A thread that allocates while another does gets an arena of
/// its own (glibc's default), whose first heap (64 MiB) stays with it; a block that does not fit
/// there takes a further heap, which goes back to the kernel when freed whole. One arena for all
/// threads (`MALLOC_ARENA_MAX=1`) would keep that memory too, but then every allocation of the
/// pool threads queues on that arena's lock: `gemm` allocates on each call, and `calloc` takes
/// the lock even for a few bytes. This function set one arena until, with the pool threads kept
/// awake and allocating side by side, that lock cost `train_tiny` about 4% of its speed
/// (BENCHMARKS, "One arena per thread again").
///
/// What it buys on this project's 2-core machines (BENCHMARKS, "Freed memory kept in the
/// process"): `chunk_kda` forward + backward at T = 8192, each call of which frees about 70 MiB,
/// about a tenth faster (glibc had returned about 16 MiB per call to the kernel), and linear in T
/// again.
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

    /// Three buffers of `bytes` allocated, written and freed again, six times on this thread;
    /// the page faults of the last five cycles.
    fn churn(bytes: usize) -> i64 {
        let mut before = 0;
        for cycle in 0..6 {
            if cycle == 1 {
                before = faults();
            }
            let bufs: Vec<Vec<u8>> = (0..3).map(|i| vec![i as u8 + 1; bytes]).collect();
            std::hint::black_box(&bufs);
        }
        faults() - before
    }

    /// With glibc's defaults, freeing the first cycle's three 12 MiB buffers (each mapped on its
    /// own) raises the trim threshold to twice their size, 24 MiB; the 36 MiB that every later
    /// cycle frees at the top of the heap exceed it and go back to the kernel, and the next cycle
    /// faults in all 9216 pages again (45952 faults in five cycles without the call, checked).
    /// Kept, the later cycles reuse the same pages.
    #[test]
    fn freed_buffers_come_back_without_page_faults() {
        assert!(retain_freed_memory());
        assert!(retain_freed_memory(), "a second call reports the same");
        let pages = 3 * (12 << 20) / 4096;
        let faulted = churn(12 << 20);
        // Other test threads may take some of the freed memory.
        assert!(
            faulted < pages,
            "{faulted} page faults in five cycles of {pages} pages each"
        );
    }

    /// The environment variable that makes [`churn_on_a_new_thread`] run (in the child process
    /// of [`pool_threads_keep_their_memory`]); its value says whether to call
    /// [`retain_freed_memory`] first.
    const CHILD: &str = "KIMI_BURN_MEMORY_CHILD";

    /// In a fresh process: optionally [`retain_freed_memory`], then a new thread (as rayon's pool
    /// threads are) allocates, writes and frees three 12 MiB buffers six times, and the page
    /// faults of its last five cycles are printed. The thread allocates while the test harness's
    /// threads may, so it may get an arena of its own: the three fit in that arena's first heap.
    #[test]
    #[ignore = "the child process of pool_threads_keep_their_memory"]
    fn churn_on_a_new_thread() {
        let Some(retain) = std::env::var_os(CHILD) else {
            return;
        };
        if retain == "1" {
            assert!(retain_freed_memory());
        }
        let faulted = std::thread::spawn(|| churn(12 << 20))
            .join()
            .expect("the churning thread");
        println!("churn faults {faulted}");
    }

    /// The page faults [`churn_on_a_new_thread`] reports in a child process of this test binary.
    fn churn_in_a_child(retain: bool) -> i64 {
        let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                "ops::backend::memory::tests::churn_on_a_new_thread",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, if retain { "1" } else { "0" })
            .output()
            .expect("the child process runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "the child failed: {stdout}");
        stdout
            .lines()
            .find_map(|line| line.split("churn faults ").nth(1))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no fault count in the child's output: {stdout}"))
    }

    /// A thread that starts after [`retain_freed_memory`] keeps what it frees: its later cycles
    /// fault in (almost) nothing, where the same thread without the call faults in at least one
    /// 12 MiB buffer per cycle again (its heap or the main one trimmed at each cycle's end). The
    /// control shows that this machine's glibc behaves as the setting assumes; both run in fresh
    /// processes, since the setting is the whole process's and arenas once made stay.
    #[test]
    fn pool_threads_keep_their_memory() {
        let pages = (12i64 << 20) / 4096;
        let without = churn_in_a_child(false);
        assert!(
            without >= 5 * pages,
            "without the setting a new thread faulted in only {without} pages in five cycles \
             (expected at least {} for one 12 MiB buffer per cycle)",
            5 * pages
        );
        let with = churn_in_a_child(true);
        assert!(
            with < pages,
            "with the setting a new thread still faulted in {with} pages in five cycles \
             (without: {without})"
        );
    }
}
