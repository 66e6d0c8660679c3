//! The host kernels' buffers: [`HostArray`] (values and shape), what holds the values
//! ([`HostData`]: a vector of the crate's, or an ndarray tensor's buffer read in place), new
//! outputs that their jobs zero row by row ([`Fresh`]), disjoint writes from several threads
//! ([`DisjointWrites`]) and a pool of working buffers ([`scratch`]).

use std::fmt::Debug;

/// A tensor on the host for the CPU host kernels: row-major `f32` values and their shape (the
/// checkpoint store has its own [`HostTensor`](crate::store::HostTensor), which keeps the checkpoint
/// shape).
#[derive(Debug, Clone)]
pub(crate) struct HostArray {
    /// Row-major values.
    pub data: HostData,
    /// The shape.
    pub shape: Vec<usize>,
}

impl HostArray {
    /// Zeros of the given shape. A large buffer asks for transparent huge pages first
    /// ([`zeroed`]).
    pub fn zeros(shape: &[usize]) -> Self {
        Self {
            data: HostData::Owned(zeroed(shape.iter().product())),
            shape: shape.to_vec(),
        }
    }
}

/// Buffers from this many bytes on are worth huge pages.
const HUGE_PAGE_BYTES: usize = 4 << 20;

/// `len` zeros. From [`HUGE_PAGE_BYTES`] on, the 2 MiB-aligned part of the buffer is advised to be
/// backed by transparent huge pages (Linux, `madvise(MADV_HUGEPAGE)`) before anything touches
/// it: an output the allocator maps afresh on every call (glibc does, for large buffers) then
/// faults in 2 MiB at a time instead of 4 KiB, which at T = 8192 were most of the KDA backward's
/// thousands of faults per call. Only a hint: where the kernel declines, nothing changes.
fn zeroed(len: usize) -> Vec<f32> {
    let v = vec![0.0f32; len];
    advise_huge_pages(v.as_ptr(), len);
    v
}

/// The huge-page advice of [`zeroed`] for the `len` floats at `ptr` (nothing below
/// [`HUGE_PAGE_BYTES`], nor off Linux).
fn advise_huge_pages(ptr: *const f32, len: usize) {
    #[cfg(target_os = "linux")]
    if len * 4 >= HUGE_PAGE_BYTES {
        const HUGE: usize = 2 << 20;
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize + len * 4) / HUGE * HUGE;
        if end > start {
            // SAFETY: `[start, end)` lies inside the caller's allocation, which is alive; the
            // advice changes how its pages are backed, never their contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// An output of `len` floats that a kernel's threads fill row by row through
/// [`DisjointWrites::fresh`], each row zeroed by the thread that takes it, just before it writes
/// it. Zeroing the whole output first ([`zeroed`]) is a pass over memory on the calling thread
/// while the pool waits (glibc's `calloc` clears a reused heap block with `memset`): about a
/// tenth of the KDA forward + backward at T = 2048, whose five gradients are 8.5 MiB together.
pub(crate) struct Fresh {
    /// Capacity `len`; its length stays 0 until [`Fresh::into_vec`].
    buf: Vec<f32>,
    len: usize,
    /// Every element zeroed already ([`Fresh::zero_all`]).
    zeroed: bool,
}

impl Fresh {
    /// `len` floats, none written yet (with the huge-page advice of [`zeroed`]).
    pub fn new(len: usize) -> Self {
        #[allow(unused_mut)]
        let mut buf = Vec::with_capacity(len);
        advise_huge_pages(buf.as_ptr(), len);
        // In the crate's own tests every element starts as NaN, so that an element that no row
        // covers shows, whatever memory the allocator hands out.
        #[cfg(test)]
        {
            buf.resize(len, f32::NAN);
            buf.clear();
        }
        Self {
            buf,
            len,
            zeroed: false,
        }
    }

    /// Zeroes every element now: for an output some of whose rows no thread takes.
    pub fn zero_all(&mut self) {
        self.buf.clear();
        self.buf.resize(self.len, 0.0);
        self.zeroed = true;
    }

    /// The values, once written.
    ///
    /// # Safety
    /// Unless [`Fresh::zero_all`] was called, every element must lie in a row handed out by the
    /// [`DisjointWrites::fresh`] of this buffer (which zeroes the row before handing it out).
    pub unsafe fn into_vec(mut self) -> Vec<f32> {
        if !self.zeroed {
            // SAFETY: every element was written (the caller's contract); the capacity is `len`.
            unsafe { self.buf.set_len(self.len) };
        }
        self.buf
    }
}

/// The values of a [`HostArray`]: its own buffer, or (for an ndarray `f32` tensor in standard
/// layout) the tensor's buffer itself, shared and read in place. Reading an input costs no copy
/// and, more to the point on a CPU, no fresh pages: large new buffers are mapped afresh by the
/// allocator and every page is faulted in on first touch, which cost more than the KDA kernel.
#[derive(Clone)]
pub(crate) enum HostData {
    /// A buffer of our own.
    Owned(Vec<f32>),
    /// An ndarray tensor's buffer, read in place (never written: `DerefMut` copies it first).
    #[cfg(feature = "ndarray")]
    NdArray(burn::backend::ndarray::NdArrayTensor),
}

impl HostData {
    /// The values to write in place, when nothing else holds them: the buffer itself when owned,
    /// an ndarray tensor's buffer when the tensor's last handle was handed over (a decode loop's
    /// state, say); `None` when another handle still reads it. Unlike `DerefMut`, never copies.
    pub fn unique_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            Self::Owned(v) => Some(v),
            #[cfg(feature = "ndarray")]
            Self::NdArray(burn::backend::ndarray::NdArrayTensor::F32(storage))
                if storage.is_unique() =>
            {
                storage.ensure_owned().as_slice_mut()
            }
            #[cfg(feature = "ndarray")]
            Self::NdArray(_) => None,
        }
    }

    /// The values as a `Vec`, moved out when owned, copied otherwise.
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            Self::Owned(v) => v,
            #[cfg(feature = "ndarray")]
            Self::NdArray(_) => self.to_vec(),
        }
    }
}

impl std::ops::Deref for HostData {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Self::Owned(v) => v,
            #[cfg(feature = "ndarray")]
            Self::NdArray(nd) => ndarray_slice(nd)
                .unwrap_or_else(|| unreachable!("only contiguous f32 tensors are shared")),
        }
    }
}

impl std::ops::DerefMut for HostData {
    fn deref_mut(&mut self) -> &mut [f32] {
        #[cfg(feature = "ndarray")]
        if let Self::NdArray(_) = self {
            *self = Self::Owned(self.to_vec());
        }
        match self {
            Self::Owned(v) => v,
            #[cfg(feature = "ndarray")]
            Self::NdArray(_) => unreachable!("made owned above"),
        }
    }
}

impl Debug for HostData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostData({} values)", self.len())
    }
}

impl PartialEq for HostData {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl FromIterator<f32> for HostData {
    fn from_iter<I: IntoIterator<Item = f32>>(iter: I) -> Self {
        Self::Owned(iter.into_iter().collect())
    }
}

impl<'a> IntoIterator for &'a HostData {
    type Item = &'a f32;
    type IntoIter = std::slice::Iter<'a, f32>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl From<Vec<f32>> for HostData {
    fn from(v: Vec<f32>) -> Self {
        Self::Owned(v)
    }
}

/// The values of an ndarray `f32` tensor in standard layout, in place.
#[cfg(feature = "ndarray")]
pub(super) fn ndarray_slice(nd: &burn::backend::ndarray::NdArrayTensor) -> Option<&[f32]> {
    match nd {
        burn::backend::ndarray::NdArrayTensor::F32(storage) => {
            let view = storage.view();
            let slice = view.as_slice()?;
            // SAFETY: the slice points into `storage`'s buffer, which `nd` keeps alive and
            // unchanged for the lifetime of the borrow of `nd` (the view itself is a temporary).
            Some(unsafe { std::slice::from_raw_parts(slice.as_ptr(), slice.len()) })
        }
        _ => None,
    }
}

/// A buffer that several threads write at once, each thread to its own elements (the rows of one
/// head of a `[B, T, H, X]` tensor, say), so that a host kernel writes its results in place instead
/// of gathering them from per-thread copies.
pub(crate) struct DisjointWrites<'a> {
    ptr: *mut f32,
    len: usize,
    /// Zero each slice before handing it out ([`DisjointWrites::fresh`]).
    fresh: bool,
    _buffer: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: the buffer is borrowed mutably for 'a, and `slice`'s contract rules out overlapping
// writes, so sharing the pointer between threads is as safe as splitting the slice.
unsafe impl Send for DisjointWrites<'_> {}
// SAFETY: as above.
unsafe impl Sync for DisjointWrites<'_> {}

impl<'a> DisjointWrites<'a> {
    /// Wraps `buffer` for the duration of its borrow.
    pub fn new(buffer: &'a mut [f32]) -> Self {
        Self {
            ptr: buffer.as_mut_ptr(),
            len: buffer.len(),
            fresh: false,
            _buffer: std::marker::PhantomData,
        }
    }

    /// Wraps an output not written yet: every [`slice`](Self::slice) is zeroed before it is
    /// handed out, so a slice must be taken once only (a second one would zero the first one's
    /// writes).
    pub fn fresh(buffer: &'a mut Fresh) -> Self {
        Self {
            ptr: buffer.buf.as_mut_ptr(),
            len: buffer.len,
            fresh: !buffer.zeroed,
            _buffer: std::marker::PhantomData,
        }
    }

    /// The buffer's first element: for reading elements that no slice of this buffer alive at
    /// the same time covers (an op that writes its results over the input it reads, say).
    pub fn as_ptr(&self) -> *const f32 {
        self.ptr
    }

    /// Requests elements `start..start + len` for writing ahead of [`slice`](Self::slice) (see
    /// [`crate::ops::backend::simd::prefetch_write`]); makes no slice and writes nothing.
    #[inline(always)]
    pub fn prefetch_write(&self, start: usize, len: usize) {
        if start <= self.len && len <= self.len - start {
            crate::ops::backend::simd::prefetch_write(self.ptr.wrapping_add(start), len);
        }
    }

    /// Elements `start..start + len` (zeros first, from [`DisjointWrites::fresh`]).
    ///
    /// # Safety
    /// No two slices alive at the same time, from any thread, may overlap.
    ///
    /// # Panics
    /// When the range is out of bounds.
    #[allow(clippy::mut_from_ref)] // disjointness is the caller's contract, as for `split_at_mut`
    #[inline(always)]
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(
            start <= self.len && len <= self.len - start,
            "range {start}..{} of a buffer of {}",
            start + len,
            self.len
        );
        // SAFETY: in bounds (checked above), and the caller guarantees no overlap. A fresh
        // buffer's range is written (zeros) before the slice is made.
        unsafe {
            let at = self.ptr.add(start);
            if self.fresh {
                std::ptr::write_bytes(at, 0, len);
            }
            std::slice::from_raw_parts_mut(at, len)
        }
    }
}

/// Buffers of at least this many floats go back to the [`scratch`] pool; smaller ones come from
/// the allocator's heap cheaply enough.
const POOL_MIN: usize = 1 << 16;

/// The most floats the [`scratch`] pool keeps (1 GiB).
const POOL_MAX: usize = 1 << 28;

/// Large scratch buffers of the host kernels, kept between calls. Every buffer here has every
/// element up to its capacity initialised (`len == capacity`).
///
/// A fresh large allocation is mapped afresh by the allocator, and every page is faulted in (and
/// zeroed by the kernel) on first touch: on the benchmark machine that cost as much as the
/// arithmetic of the MoE layer's activations. Buffers that the kernels fill and drop every call
/// (the experts' hidden rows, the KDA checkpoints) come from here instead.
static POOL: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

/// A buffer of the [`scratch`] pool: `len` floats whose contents are unspecified (the caller
/// overwrites them), handed back to the pool when dropped. Its allocation may be longer than
/// `len`; the rest is never cleared (an earlier version refilled it on every return, a `memset`
/// that cost a tenth of the MoE layer's backward).
pub(crate) struct Scratch {
    /// The whole allocation, every element initialised (`len == capacity`).
    buf: Vec<f32>,
    /// The length handed out.
    len: usize,
}

impl std::ops::Deref for Scratch {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.buf[..self.len]
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[..self.len]
    }
}

impl Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scratch({} values)", self.len)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if buf.len() < POOL_MIN {
            return;
        }
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        pool.push(buf);
        let mut total: usize = pool.iter().map(Vec::len).sum();
        while total > POOL_MAX && !pool.is_empty() {
            total -= pool.remove(0).len();
        }
    }
}

/// A [`Scratch`] buffer of `len` floats: a pooled one when one is large enough (the smallest such),
/// else a new one.
pub(crate) fn scratch(len: usize) -> Scratch {
    if len >= POOL_MIN {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let best = pool
            .iter()
            .enumerate()
            .filter(|(_, v)| v.len() >= len)
            .min_by_key(|(_, v)| v.len())
            .map(|(i, _)| i);
        if let Some(i) = best {
            return Scratch {
                buf: pool.swap_remove(i),
                len,
            };
        }
    }
    let buf = vec![0.0; len];
    debug_assert_eq!(buf.len(), buf.capacity());
    Scratch { buf, len }
}
