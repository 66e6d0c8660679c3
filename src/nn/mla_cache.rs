//! The decode state of one MLA layer: the compressed latent, not per-head keys and values.

use burn::tensor::{backend::Backend, Bool, Tensor};

use crate::error::{Error, Result};

/// Per-token decode cache of one [`GatedMla`](super::GatedMla) layer (design §5): the normalised
/// latent `c: [B, T, kv_lora_rank]` and the shared key slice `k_pe: [B, T, qk_rope_head_dim]`,
/// 576 values per token and layer in the real models, against `H·(dn + dv)` for a per-head cache.
///
/// Tokens are appended by [`GatedMla::forward_cached`](super::GatedMla::forward_cached); a
/// padding mask given there is kept (`[B, T]`, `true` = padding) so that later tokens never
/// attend to padding. Appending concatenates, which copies the cache: simple, and cheap next to
/// the attention over it.
#[derive(Debug, Clone)]
pub struct MlaCache<B: Backend> {
    latent: Option<Tensor<B, 3>>,
    k_pe: Option<Tensor<B, 3>>,
    padding: Option<Tensor<B, 2, Bool>>,
}

impl<B: Backend> Default for MlaCache<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> MlaCache<B> {
    /// An empty cache; the batch size is fixed by the first append.
    pub fn new() -> Self {
        Self {
            latent: None,
            k_pe: None,
            padding: None,
        }
    }

    /// Cached tokens `T`.
    pub fn len(&self) -> usize {
        self.latent.as_ref().map_or(0, |c| c.dims()[1])
    }

    /// Whether no token has been cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cached `(c [B, T, r], k_pe [B, T, dr])`, or `None` when empty.
    pub fn tensors(&self) -> Option<(Tensor<B, 3>, Tensor<B, 3>)> {
        Some((self.latent.clone()?, self.k_pe.clone()?))
    }

    /// The padding mask of the cached tokens `[B, T]` (`true` = padding), or `None` when no
    /// padding was ever given (every token is valid).
    pub fn padding(&self) -> Option<Tensor<B, 2, Bool>> {
        self.padding.clone()
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
        let (Some(old_c), Some(old_pe)) = (&self.latent, &self.k_pe) else {
            self.latent = Some(latent);
            self.k_pe = Some(k_pe);
            self.padding = padding;
            return Ok(());
        };
        let [old_batch, old_t, old_r] = old_c.dims();
        let old_dr = old_pe.dims()[2];
        if [old_batch, old_r, old_dr] != [batch, r, dr] {
            return Err(Error::shape(
                "new tokens (batch, kv_lora_rank, qk_rope_head_dim)",
                format!("[{old_batch}, {old_r}, {old_dr}] as in the cache"),
                [batch, r, dr],
            ));
        }
        // Earlier tokens without a mask were all valid, and so are new ones without one.
        self.padding = match (self.padding.take(), padding) {
            (None, None) => None,
            (old, new) => {
                let device = latent.device();
                let old = old
                    .unwrap_or_else(|| Tensor::<B, 2, Bool>::full([batch, old_t], false, &device));
                let new =
                    new.unwrap_or_else(|| Tensor::<B, 2, Bool>::full([batch, t], false, &device));
                Some(Tensor::cat(vec![old, new], 1))
            }
        };
        self.latent = Some(Tensor::cat(vec![old_c.clone(), latent], 1));
        self.k_pe = Some(Tensor::cat(vec![old_pe.clone(), k_pe], 1));
        Ok(())
    }
}
