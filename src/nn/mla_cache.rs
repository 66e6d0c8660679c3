//! The decode state of one MLA layer: the compressed latent, not per-head keys and values.

use burn::tensor::{backend::Backend, Bool, Tensor};

use crate::error::{Error, Result};

/// Per-token decode cache of one [`GatedMla`](super::GatedMla) layer (design §5): the normalised
/// latent `c: [B, T, kv_lora_rank]` and the shared key slice `k_pe: [B, T, qk_rope_head_dim]`,
/// 576 values per token and layer in the real models, against `H·(dn + dv)` for a per-head cache.
///
/// Tokens are appended by [`GatedMla::forward_cached`](super::GatedMla::forward_cached); a
/// padding mask given there is kept (`[B, T]`, `true` = padding) so that later tokens never
/// attend to padding. The cache is stored in buffers of a capacity ([`with_capacity`](Self::with_capacity),
/// e.g. prompt plus new tokens) that new tokens are written into in place; a buffer that fills up
/// is reallocated at twice the size (or what the append needs), so appends cost amortised
/// `O(new tokens)`, not a copy of the whole cache per token.
#[derive(Debug, Clone)]
pub struct MlaCache<B: Backend> {
    latent: Option<Tensor<B, 3>>,
    k_pe: Option<Tensor<B, 3>>,
    padding: Option<Tensor<B, 2, Bool>>,
    len: usize,
    capacity: usize,
}

impl<B: Backend> Default for MlaCache<B> {
    fn default() -> Self {
        Self::new()
    }
}

/// `buffer[:, at..at + t, ..] = new` (`t = new.dims()[1]`), first growing `buffer` along axis 1 to
/// hold `needed` positions (at least twice its size). Positions past the cached tokens are never
/// read, so the grown part is left uninitialised.
fn write_at<B: Backend, const D: usize, K>(
    buffer: Tensor<B, D, K>,
    new: Tensor<B, D, K>,
    at: usize,
    needed: usize,
) -> Tensor<B, D, K>
where
    K: burn::tensor::BasicOps<B>,
{
    let dims = buffer.dims();
    let buffer = if dims[1] < needed {
        let mut extra = dims;
        extra[1] = needed.max(2 * dims[1]) - dims[1];
        let tail = Tensor::<B, D, K>::empty(extra, &buffer.device());
        Tensor::cat(vec![buffer, tail], 1)
    } else {
        buffer
    };
    let nd = new.dims();
    let range: [std::ops::Range<usize>; D] =
        std::array::from_fn(|i| if i == 1 { at..at + nd[1] } else { 0..nd[i] });
    buffer.slice_assign(range, new)
}

impl<B: Backend> MlaCache<B> {
    /// An empty cache; the batch size is fixed by the first append, the buffers sized by it.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty cache whose buffers hold `tokens` positions from the first append on (more are
    /// allocated when needed).
    pub fn with_capacity(tokens: usize) -> Self {
        Self {
            latent: None,
            k_pe: None,
            padding: None,
            len: 0,
            capacity: tokens,
        }
    }

    /// Cached tokens `T`.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token has been cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the buffers hold before they must grow (0 before the first append).
    pub fn capacity(&self) -> usize {
        self.latent.as_ref().map_or(0, |c| c.dims()[1])
    }

    /// The cached `(c [B, T, r], k_pe [B, T, dr])`, or `None` when empty.
    pub fn tensors(&self) -> Option<(Tensor<B, 3>, Tensor<B, 3>)> {
        if self.len == 0 {
            return None;
        }
        Some((
            self.latent.clone()?.narrow(1, 0, self.len),
            self.k_pe.clone()?.narrow(1, 0, self.len),
        ))
    }

    /// The padding mask of the cached tokens `[B, T]` (`true` = padding), or `None` when no
    /// padding was ever given (every token is valid).
    pub fn padding(&self) -> Option<Tensor<B, 2, Bool>> {
        Some(self.padding.clone()?.narrow(1, 0, self.len))
    }

    /// Appends `latent: [B, t, r]`, `k_pe: [B, t, dr]` and their optional padding `[B, t]`.
    /// Fails, leaving the cache unchanged, when the batch or the widths differ from the cached
    /// tokens'.
    pub fn append(
        &mut self,
        latent: Tensor<B, 3>,
        k_pe: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
    ) -> Result<()> {
        let [batch, t, r] = latent.dims();
        let dr = k_pe.dims()[2];
        if k_pe.dims() != [batch, t, dr] {
            return Err(Error::shape(
                "k_pe",
                format!("[{batch}, {t}, qk_rope_head_dim]"),
                k_pe.dims(),
            ));
        }
        if let Some(pad) = &padding {
            if pad.dims() != [batch, t] {
                return Err(Error::shape(
                    "padding",
                    format!("[{batch}, {t}]"),
                    pad.dims(),
                ));
            }
        }
        if let (Some(old_c), Some(old_pe)) = (&self.latent, &self.k_pe) {
            let [old_batch, _, old_r] = old_c.dims();
            let old_dr = old_pe.dims()[2];
            if [old_batch, old_r, old_dr] != [batch, r, dr] {
                return Err(Error::shape(
                    "new tokens (batch, kv_lora_rank, qk_rope_head_dim)",
                    format!("[{old_batch}, {old_r}, {old_dr}] as in the cache"),
                    [batch, r, dr],
                ));
            }
        }
        let device = latent.device();
        let (at, needed) = (self.len, self.len + t);
        let fresh = |width: usize| {
            Tensor::<B, 3>::empty(
                [batch, self.capacity.max(needed), width],
                (&device, latent.dtype()),
            )
        };
        let c = self.latent.take().unwrap_or_else(|| fresh(r));
        let pe = self.k_pe.take().unwrap_or_else(|| fresh(dr));
        // Earlier tokens without a mask were all valid, and so are new ones without one.
        if padding.is_some() || self.padding.is_some() {
            let cap = c.dims()[1];
            let old = self
                .padding
                .take()
                .unwrap_or_else(|| Tensor::<B, 2, Bool>::full([batch, cap], false, &device));
            let new =
                padding.unwrap_or_else(|| Tensor::<B, 2, Bool>::full([batch, t], false, &device));
            self.padding = Some(write_at(old, new, at, needed));
        }
        self.latent = Some(write_at(c, latent, at, needed));
        self.k_pe = Some(write_at(pe, k_pe, at, needed));
        self.len = needed;
        Ok(())
    }
}
