//! Matrix products on host buffers for the CPU host kernels, by the `gemm` crate's f32 kernels
//! (`gemm-f32`, what several Rust ML libraries use: register-blocked, AVX-512 / AVX2+FMA / NEON
//! chosen at run time, threads from rayon's pool for large products).

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

/// Products with at least this many multiply-adds use rayon's thread pool: the `gemm` kernels'
/// own threads when they would take them ([`gemm_threads`]), otherwise the rows of the result in
/// two halves ([`product_raw`]). Smaller ones stay on the calling thread, where handing work to
/// the pool would cost more than it saves. (`train_tiny`'s narrow products, 0.5–2 M
/// multiply-adds, gained from the halves with the pool's threads kept awake by
/// [`on_cpu_pool`](super::on_cpu_pool); the threshold itself was not tuned.)
pub(crate) const MIN_PARALLEL_FLOPS: usize = 1 << 18;

/// The kernels' own threads start at this many multiply-adds: the one threshold of the products
/// before the halves existed (chosen when an idle pool thread slept and each op woke it), kept.
const MIN_GEMM_THREADS_FLOPS: usize = 1 << 21;

/// How a matrix operand is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// As it is used: `[rows, cols]`, row-major.
    Plain,
    /// Transposed: the matrix `[rows, cols]` is stored as `[cols, rows]`, row-major.
    Transposed,
}

/// `c = a · b` (with `accumulate`, `c += a · b`) for `a: [m, k]`, `b: [k, n]` and `c: [m, n]`, all
/// row-major `f32`, each of `a` and `b` possibly stored transposed.
///
/// # Panics
/// When a buffer is shorter than its shape.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    c: &mut [f32],
    a: &[f32],
    a_layout: Layout,
    b: &[f32],
    b_layout: Layout,
    [m, k, n]: [usize; 3],
    accumulate: bool,
) {
    let parallel = m * n * k >= MIN_PARALLEL_FLOPS;
    product(c, a, a_layout, b, b_layout, [m, k, n], accumulate, parallel);
}

/// [`matmul`] on the calling thread whatever the size (for products that are themselves run in
/// parallel, one per expert say).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_serial(
    c: &mut [f32],
    a: &[f32],
    a_layout: Layout,
    b: &[f32],
    b_layout: Layout,
    dims: [usize; 3],
    accumulate: bool,
) {
    product(c, a, a_layout, b, b_layout, dims, accumulate, false);
}

/// `a · b` into a new `[m, n]` buffer, by [`matmul`]: the product writes every element, so the
/// buffer is not zeroed first (a pass over memory as long as the output, for nothing).
pub(crate) fn matmul_new(
    a: &[f32],
    a_layout: Layout,
    b: &[f32],
    b_layout: Layout,
    [m, k, n]: [usize; 3],
) -> Vec<f32> {
    let mut c = Vec::with_capacity(m * n);
    let parallel = m * n * k >= MIN_PARALLEL_FLOPS;
    let out = c.spare_capacity_mut();
    // SAFETY: `out` holds `m · n` floats; without accumulation the product only writes `c`.
    unsafe {
        product_raw(
            out.as_mut_ptr().cast(),
            out.len(),
            a,
            a_layout,
            b,
            b_layout,
            [m, k, n],
            false,
            parallel,
        );
        c.set_len(m * n);
    }
    c
}

#[allow(clippy::too_many_arguments)]
fn product(
    c: &mut [f32],
    a: &[f32],
    a_layout: Layout,
    b: &[f32],
    b_layout: Layout,
    dims: [usize; 3],
    accumulate: bool,
    parallel: bool,
) {
    // SAFETY: `c` is `c.len()` initialised floats, borrowed mutably.
    unsafe {
        product_raw(
            c.as_mut_ptr(),
            c.len(),
            a,
            a_layout,
            b,
            b_layout,
            dims,
            accumulate,
            parallel,
        )
    }
}

/// [`product`] into `c_len` floats at `c`, which may be uninitialised when `accumulate` is false
/// (every element of `[m, n]` is then written and none read).
///
/// # Safety
/// `c` must be valid for writes of `c_len` floats (and for reads when `accumulate`) and overlap
/// neither `a` nor `b`.
#[allow(clippy::too_many_arguments)]
unsafe fn product_raw(
    c: *mut f32,
    c_len: usize,
    a: &[f32],
    a_layout: Layout,
    b: &[f32],
    b_layout: Layout,
    [m, k, n]: [usize; 3],
    accumulate: bool,
    parallel: bool,
) {
    assert!(
        a.len() >= m * k && b.len() >= k * n && c_len >= m * n,
        "matmul [{m}, {k}] x [{k}, {n}]: buffers of {}, {}, {c_len}",
        a.len(),
        b.len(),
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            // SAFETY: `c` is valid for `m · n ≤ c_len` writes (the caller's contract).
            unsafe { std::ptr::write_bytes(c, 0, m * n) };
        }
        return;
    }
    let threads = parallel && gemm_threads([m, k, n]);
    let operands = Operands::new(a, a_layout, b, b_layout, [m, k, n], accumulate, threads);
    if parallel && !threads && m >= 2 * SPLIT_ROWS && rayon::current_num_threads() > 1 {
        // Two halves of the rows of `c`, one per task: each element of `c` is the same chain of
        // multiply-adds whichever call computes it, so the results are the same bits.
        let half = (m / 2).next_multiple_of(SPLIT_ROWS);
        let (top, bottom) = (operands.rows(0..half), operands.rows(half..m));
        // As an address: a raw pointer is not `Send`.
        let c = c as usize;
        rayon::join(
            // SAFETY: the halves write disjoint rows of `c` (the caller's contract for the whole).
            || unsafe { product_on_this_thread(c as *mut f32, &top) },
            || unsafe { product_on_this_thread((c as *mut f32).add(half * n), &bottom) },
        );
    } else {
        // SAFETY: the caller's contract, with the lengths checked above.
        unsafe { product_on_this_thread(c, &operands) }
    }
}

/// Rows of the result per half when [`product_raw`] splits a product itself: a vector of the
/// `gemm` kernels with AVX-512.
const SPLIT_ROWS: usize = 16;

/// Whether the `gemm` kernels split a product of this size over rayon's threads when asked to:
/// from [`MIN_GEMM_THREADS_FLOPS`] multiply-adds, and only where each of their blocks of `k`
/// holds at least their own threshold of work; below that they run it on one thread (a narrow
/// layer's product, say, `[4096, 64] × [64, 2]`). Their blocks of `k` are at least 512 long (or
/// all of `k`), so this count is a lower bound of theirs: where it says no, the kernels may still
/// have taken threads, and the product is split in halves instead.
fn gemm_threads([m, k, n]: [usize; 3]) -> bool {
    m * k * n >= MIN_GEMM_THREADS_FLOPS
        && m * n * k.min(512) >= gemm_common::gemm::get_threading_threshold()
}

/// The product on the calling thread (the kernels' own threads when the operands ask for them):
/// [`narrow_product`] or [`product_of_transposes`].
///
/// # Safety
/// As [`product_raw`]'s, the operands' lengths checked there.
unsafe fn product_on_this_thread(c: *mut f32, o: &Operands<'_>) {
    let [m, _, n] = o.dims;
    // SAFETY: passed on.
    unsafe {
        if o.a_transposed && n <= NARROW && m > n {
            narrow_product(c, o)
        } else {
            product_of_transposes(c, o)
        }
    }
}

/// The operands of one product as the `gemm` kernels take them.
struct Operands<'a> {
    a: &'a [f32],
    /// Whether `a` is stored transposed.
    a_transposed: bool,
    /// `a`'s column and row strides, in elements.
    a_cs: isize,
    a_rs: isize,
    b: &'a [f32],
    /// `b`'s column and row strides.
    b_cs: isize,
    b_rs: isize,
    /// `[m, k, n]`, none of them 0.
    dims: [usize; 3],
    accumulate: bool,
    parallelism: gemm_common::Parallelism,
}

impl<'a> Operands<'a> {
    fn new(
        a: &'a [f32],
        a_layout: Layout,
        b: &'a [f32],
        b_layout: Layout,
        [m, k, n]: [usize; 3],
        accumulate: bool,
        parallel: bool,
    ) -> Self {
        let (a_cs, a_rs) = match a_layout {
            Layout::Plain => (1, k as isize),
            Layout::Transposed => (m as isize, 1),
        };
        let (b_cs, b_rs) = match b_layout {
            Layout::Plain => (1, n as isize),
            Layout::Transposed => (k as isize, 1),
        };
        let parallelism = if parallel {
            gemm_common::Parallelism::Rayon(0)
        } else {
            gemm_common::Parallelism::None
        };
        Self {
            a,
            a_transposed: a_layout == Layout::Transposed,
            a_cs,
            a_rs,
            b,
            b_cs,
            b_rs,
            dims: [m, k, n],
            accumulate,
            parallelism,
        }
    }

    /// The product of the rows `rows` of `a` (so of the result) alone, on one thread.
    fn rows(&self, rows: std::ops::Range<usize>) -> Self {
        let [_, k, n] = self.dims;
        Self {
            // Row `i` starts at `i` times the row stride, whichever the layout.
            a: &self.a[rows.start * self.a_rs as usize..],
            dims: [rows.len(), k, n],
            parallelism: gemm_common::Parallelism::None,
            ..*self
        }
    }
}

/// The product by the `gemm` kernels, which want a column-major destination: they compute
/// `Cᵀ = Bᵀ·Aᵀ`, whose column-major layout is `C`'s row-major one (what the `gemm` facade does
/// before calling them).
///
/// # Safety
/// As [`product_raw`]'s, the operands' lengths checked there.
unsafe fn product_of_transposes(c: *mut f32, o: &Operands<'_>) {
    let [m, k, n] = o.dims;
    // SAFETY: the strides address `[m, k]`, `[k, n]` and `[m, n]` elements within the lengths
    // checked by the caller; `c` overlaps neither input (the caller's contract). Without
    // accumulation (`read_dst` false) the kernels write `c` and never read it.
    unsafe {
        kernels(
            [n, m, k],
            (c, n as isize, 1),
            o.accumulate,
            (o.b.as_ptr(), o.b_rs, o.b_cs),
            (o.a.as_ptr(), o.a_rs, o.a_cs),
            o.parallelism,
        )
    }
}

/// `dst = lhs · rhs` (`dst += …` with `read_dst`) by the `gemm` kernels, for `[m, n, k]`; each
/// matrix as its pointer, column stride and row stride, in elements.
///
/// # Safety
/// The pointers and strides must address the `[m, n]`, `[m, k]` and `[k, n]` elements within
/// their buffers, `dst` valid for writes (and for reads with `read_dst`) and overlapping neither
/// input.
unsafe fn kernels(
    [m, n, k]: [usize; 3],
    (dst, dst_cs, dst_rs): (*mut f32, isize, isize),
    read_dst: bool,
    (lhs, lhs_cs, lhs_rs): (*const f32, isize, isize),
    (rhs, rhs_cs, rhs_rs): (*const f32, isize, isize),
    parallelism: gemm_common::Parallelism,
) {
    // SAFETY: the caller's contract. Without `read_dst` the kernels write `dst` and never read it.
    unsafe {
        gemm_f32::gemm::f32::get_gemm_fn()(
            m,
            n,
            k,
            dst,
            dst_cs,
            dst_rs,
            read_dst,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Products with at most this many columns whose `a` is stored transposed go through
/// [`narrow_product`].
const NARROW: usize = 16;

/// The product for few columns `n` and `a` stored transposed: the weight gradient `Xᵀ · dY` of a
/// layer with few outputs (the KDA `β` projection, a router), whose `k` (the tokens) is long.
///
/// The `gemm` kernels block the rows of their (column-major) destination by 64 (with AVX-512)
/// and its columns by 6. [`product_of_transposes`] hands them `Cᵀ`: with `n` = 2, 2 of each 64
/// rows of a block did work. Here they compute `C` itself, column-major, into a buffer of `m · n`
/// floats that is then transposed into `c`: at `m` = 64 and `k` = 4096, 1.6× faster with 16
/// columns, 3× with 8, 9× with 2 (a probe on the 2-core Intel Xeon VM; with `a` stored plain the
/// kernels must pack it first, and the gain was gone). Each element is the same chain of
/// multiply-adds over `k` in either orientation, so the results are the same bits (a test checks
/// it).
///
/// # Safety
/// As [`product_raw`]'s, the operands' lengths checked there.
unsafe fn narrow_product(c: *mut f32, o: &Operands<'_>) {
    let [m, k, n] = o.dims;
    // `C` column-major. When accumulating it starts as `c` (transposed), so that the kernels add
    // each block of `k` into it as they would into `c`: the same sums in the same order.
    let mut t = Vec::<f32>::with_capacity(m * n);
    if o.accumulate {
        for j in 0..n {
            // SAFETY: `i · n + j < m · n`, within `c`, which is initialised when accumulating
            // (the caller's contract).
            t.extend((0..m).map(|i| unsafe { *c.add(i * n + j) }));
        }
    }
    // SAFETY: `t` has room for the `m · n` floats of `[m, n]` column-major (column stride `m`),
    // initialised when read (`read_dst`), all written; the strides address `a`'s `[m, k]` and
    // `b`'s `[k, n]` within the lengths the caller checked.
    unsafe {
        kernels(
            [m, n, k],
            (t.as_mut_ptr(), m as isize, 1),
            o.accumulate,
            (o.a.as_ptr(), o.a_cs, o.a_rs),
            (o.b.as_ptr(), o.b_cs, o.b_rs),
            o.parallelism,
        );
        t.set_len(m * n);
    }
    for (j, column) in t.chunks_exact(m).enumerate() {
        for (i, &v) in column.iter().enumerate() {
            // SAFETY: `i · n + j < m · n`, within `c` (the caller's contract).
            unsafe { c.add(i * n + j).write(v) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The product by three nested loops, in f64.
    fn naive(a: &[f32], ta: bool, b: &[f32], tb: bool, [m, k, n]: [usize; 3]) -> Vec<f64> {
        let at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] } as f64;
        let bt = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] } as f64;
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
            }
        }
        c
    }

    #[test]
    fn every_layout_matches_the_naive_product() {
        // The narrow path too: `a` transposed, `n ≤ NARROW < m`.
        let shapes = [
            [3, 5, 7],
            [64, 33, 17],
            [1, 1, 1],
            [130, 70, 90],
            [4, 0, 3],
            [70, 300, 5],
        ];
        for dims in shapes.into_iter().chain([[40, 9, NARROW]]) {
            let [m, k, n] = dims;
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.2)
                .collect();
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let layout = |t| if t { Layout::Transposed } else { Layout::Plain };
                let want = naive(&a, ta, &b, tb, dims);
                let mut c = vec![1.0f32; m * n];
                matmul(&mut c, &a, layout(ta), &b, layout(tb), dims, true);
                for (got, want) in c.iter().zip(&want) {
                    assert!(
                        (*got as f64 - (want + 1.0)).abs() < 1e-4,
                        "{dims:?} {ta} {tb}"
                    );
                }
                matmul(&mut c, &a, layout(ta), &b, layout(tb), dims, false);
                for (got, want) in c.iter().zip(&want) {
                    assert!((*got as f64 - want).abs() < 1e-4, "{dims:?} {ta} {tb}");
                }
                let fresh = matmul_new(&a, layout(ta), &b, layout(tb), dims);
                assert_eq!(fresh, c, "{dims:?} {ta} {tb}");
            }
        }
    }

    /// The narrow path gives the same bits as the kernels' usual orientation, accumulating or
    /// not, serial or on the pool: each element is the same chain of multiply-adds.
    #[test]
    fn the_narrow_product_has_the_bits_of_the_usual_one() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for [m, k, n] in [[64, 4096, 2], [64, 1000, 8], [33, 517, 16], [200, 3, 1]] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let start: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            for (accumulate, parallel, b_layout) in [
                (false, false, Layout::Plain),
                (true, false, Layout::Plain),
                (false, true, Layout::Transposed),
                (true, true, Layout::Transposed),
            ] {
                let o = Operands::new(
                    &a,
                    Layout::Transposed,
                    &b,
                    b_layout,
                    [m, k, n],
                    accumulate,
                    parallel,
                );
                let (mut usual, mut narrow) = (start.clone(), start.clone());
                // SAFETY: both buffers hold `m · n` initialised floats; the operands' lengths
                // are those of their shapes.
                unsafe {
                    product_of_transposes(usual.as_mut_ptr(), &o);
                    narrow_product(narrow.as_mut_ptr(), &o);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&usual),
                    bits(&narrow),
                    "[{m}, {k}, {n}] accumulate {accumulate} parallel {parallel} {b_layout:?}"
                );
            }
        }
    }

    /// Products that the kernels would run on one thread are split in two halves of rows
    /// ([`product_raw`]), with the same bits as the product on one thread; and the kernels' own
    /// threads give the same bits too.
    #[test]
    fn split_and_threaded_products_have_the_bits_of_the_serial_one() {
        // A pool of two threads of its own, so that the split is taken on a machine of any size.
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool of two threads")
            .install(split_and_threaded_products_on_this_pool);
    }

    fn split_and_threaded_products_on_this_pool() {
        use rand::{Rng, SeedableRng};
        assert_eq!(rayon::current_num_threads(), 2);
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let cases = [
            ([4096, 64, 2], Layout::Plain, Layout::Plain, false),
            ([4096, 2, 64], Layout::Plain, Layout::Transposed, false),
            ([64, 4096, 8], Layout::Transposed, Layout::Plain, false),
            ([300, 40, 30], Layout::Plain, Layout::Plain, false),
            ([1000, 64, 64], Layout::Plain, Layout::Transposed, true),
        ];
        for (dims, ta, tb, threaded) in cases {
            let [m, k, n] = dims;
            assert!(m * k * n >= MIN_PARALLEL_FLOPS);
            assert_eq!(gemm_threads(dims), threaded, "{dims:?}");
            let a: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let start: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            for accumulate in [false, true] {
                let (mut serial, mut pooled) = (start.clone(), start.clone());
                matmul_serial(&mut serial, &a, ta, &b, tb, dims, accumulate);
                matmul(&mut pooled, &a, ta, &b, tb, dims, accumulate);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&serial),
                    bits(&pooled),
                    "{dims:?} accumulate {accumulate}"
                );
            }
            assert_eq!(
                matmul_new(&a, ta, &b, tb, dims),
                {
                    let mut c = vec![0.0; m * n];
                    matmul_serial(&mut c, &a, ta, &b, tb, dims, false);
                    c
                },
                "{dims:?} new"
            );
        }
    }
}
