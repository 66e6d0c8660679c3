//! Tensors of the CPU backends to the host kernels' buffers and back, without a copy where
//! ndarray allows it.

use std::any::TypeId;

use burn::tensor::{backend::Backend, ops::FloatTensor, Tensor, TensorPrimitive};
#[cfg(any(feature = "ndarray", feature = "flex"))]
use {
    burn::tensor::{DType, TensorData},
    std::any::Any,
};

#[cfg(feature = "ndarray")]
use super::ndarray_slice;
use super::{HostArray, HostData};

/// `x` as a value of type `T` when it is one.
#[cfg(any(feature = "ndarray", feature = "flex"))]
pub(super) fn cast<S: 'static, T: 'static>(x: S) -> Option<T> {
    (Box::new(x) as Box<dyn Any>)
        .downcast::<T>()
        .ok()
        .map(|b| *b)
}

/// `x` as a value of type `T` when it is one, else `x` back.
#[cfg(any(feature = "ndarray", feature = "flex"))]
pub(super) fn try_cast<S: 'static, T: 'static>(x: S) -> std::result::Result<T, S> {
    if TypeId::of::<S>() != TypeId::of::<T>() {
        return Err(x);
    }
    Ok(cast(x).unwrap_or_else(|| unreachable!("S is T")))
}

/// The shape of an ndarray `f32` tensor whose values [`ndarray_slice`] reads in place.
#[cfg(feature = "ndarray")]
fn ndarray_shape(nd: &burn::backend::ndarray::NdArrayTensor) -> Option<Vec<usize>> {
    match nd {
        burn::backend::ndarray::NdArrayTensor::F32(storage) if ndarray_slice(nd).is_some() => {
            Some(storage.shape().to_vec())
        }
        _ => None,
    }
}

/// An ndarray `f32` tensor not in standard layout (a transposed or permuted view: MLA's heads
/// moved ahead of the tokens, say) copied into a new row-major buffer, a row of the last axis at
/// a time (`None` for other element types). Burn's `into_data` does the same copy one element at
/// a time through a dynamic-rank iterator: 4% of a tiny MLA layer's training step.
#[cfg(feature = "ndarray")]
fn ndarray_copy(nd: &burn::backend::ndarray::NdArrayTensor) -> Option<HostArray> {
    let burn::backend::ndarray::NdArrayTensor::F32(storage) = nd else {
        return None;
    };
    let view = storage.view();
    let shape = view.shape().to_vec();
    let strides = view.strides().to_vec();
    let len = shape.iter().product();
    let mut out = Vec::with_capacity(len);
    if len > 0 {
        // SAFETY: `view.as_ptr()` with the view's own shape and strides addresses exactly the
        // view's elements (ndarray's invariant), all alive while `nd` is borrowed.
        unsafe { copy_strided(&mut out, view.as_ptr(), &shape, &strides) };
    }
    debug_assert_eq!(out.len(), len);
    Some(HostArray {
        data: HostData::Owned(out),
        shape,
    })
}

/// Appends the elements of the strided array at `ptr` (`shape`, `strides` in elements) to `out`
/// in row-major order: whole rows when the last axis is contiguous.
///
/// # Safety
/// `ptr` offset by `Σ i_a · strides[a]` must be a readable `f32` for every index `i` in `shape`.
#[cfg(feature = "ndarray")]
unsafe fn copy_strided(out: &mut Vec<f32>, ptr: *const f32, shape: &[usize], strides: &[isize]) {
    // SAFETY (throughout): every offset taken addresses an element of the array (the caller's
    // contract).
    unsafe {
        match (shape, strides) {
            ([], _) => out.push(*ptr),
            ([n], [1]) => out.extend_from_slice(std::slice::from_raw_parts(ptr, *n)),
            ([n], [s]) => out.extend((0..*n).map(|i| *ptr.offset(i as isize * s))),
            ([n, rest @ ..], [s, srest @ ..]) => {
                for i in 0..*n {
                    copy_strided(out, ptr.offset(i as isize * s), rest, srest);
                }
            }
            _ => unreachable!("as many strides as axes"),
        }
    }
}

/// Copies a primitive of backend `X` to the host in `f32`.
///
/// An ndarray `f32` tensor in standard layout is shared, not copied ([`HostData::NdArray`]):
/// Burn's `into_data` walks a shared array (autodiff keeps a clone of every input) element by
/// element through a dynamic-rank iterator, which cost more than the kernels themselves.
#[cfg(any(feature = "ndarray", feature = "flex"))]
pub(super) fn to_host<X: Backend>(x: FloatTensor<X>) -> HostArray {
    #[cfg(feature = "ndarray")]
    let x = match try_cast::<FloatTensor<X>, burn::backend::ndarray::NdArrayTensor>(x) {
        Ok(nd) => {
            if let Some(shape) = ndarray_shape(&nd) {
                return HostArray {
                    data: HostData::NdArray(nd),
                    shape,
                };
            }
            if let Some(copy) = ndarray_copy(&nd) {
                return copy;
            }
            try_cast(nd).unwrap_or_else(|_| unreachable!("cast back to the type it came from"))
        }
        Err(x) => x,
    };
    let data = crate::sync::read(Tensor::<X, 1>::from_primitive(TensorPrimitive::Float(x)))
        .convert_dtype(DType::F32);
    let shape = data.shape.to_vec();
    HostArray {
        data: HostData::Owned(
            data.into_vec::<f32>()
                .unwrap_or_else(|e| unreachable!("convert_dtype(F32) gives f32 data: {e:?}")),
        ),
        shape,
    }
}

/// A primitive of backend `X` holding `x`.
///
/// An ndarray tensor's buffer ([`HostData::NdArray`]) of the same shape is handed back as that
/// tensor, without a copy: an output written in place into an input's buffer.
#[cfg(any(feature = "ndarray", feature = "flex"))]
pub(super) fn from_host<X: Backend>(x: HostArray, device: &X::Device) -> FloatTensor<X> {
    let HostArray { data, shape } = x;
    #[cfg(feature = "ndarray")]
    let data = match data {
        HostData::NdArray(nd) => match ndarray_with_shape(nd, &shape) {
            Ok(nd) => match try_cast::<_, FloatTensor<X>>(nd) {
                Ok(tensor) => return tensor,
                Err(nd) => HostData::NdArray(nd),
            },
            Err(nd) => HostData::NdArray(nd),
        },
        data => data,
    };
    X::float_from_data(TensorData::new(data.into_vec(), shape), device)
}

/// An ndarray `f32` tensor read in place ([`HostData::NdArray`]) as a tensor of `shape`: itself
/// when the shape is its own, the same buffer with the new shape when the element counts agree
/// (its buffer is in standard layout, so the row-major order is kept), `Err` otherwise (the
/// caller copies). Burn 0.21's ndarray `reshape` copies even a contiguous tensor.
#[cfg(feature = "ndarray")]
pub(super) fn ndarray_with_shape(
    nd: burn::backend::ndarray::NdArrayTensor,
    shape: &[usize],
) -> std::result::Result<burn::backend::ndarray::NdArrayTensor, burn::backend::ndarray::NdArrayTensor>
{
    use burn::backend::ndarray::NdArrayTensor;
    let Some(own) = ndarray_shape(&nd) else {
        return Err(nd);
    };
    if own == shape {
        return Ok(nd);
    }
    if own.iter().product::<usize>() != shape.iter().product::<usize>() {
        return Err(nd);
    }
    match nd {
        NdArrayTensor::F32(storage) if storage.is_owned() => {
            let array = storage.into_shared();
            debug_assert!(
                array.is_standard_layout(),
                "ndarray_shape checked the layout"
            );
            let array = array
                .into_shape_with_order(shape.to_vec())
                .unwrap_or_else(|e| {
                    unreachable!("a standard-layout array of as many elements: {e}")
                });
            Ok(NdArrayTensor::from(array))
        }
        nd => Err(nd),
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Tensor, TensorData};

    use super::{ndarray_copy, ndarray_slice, to_host, HostData};

    type B = NdArray<f32>;

    /// Views in other layouts than the standard one (axes swapped, the last axis strided, an
    /// axis reversed) come to the host as the row-major values that `into_data` gives.
    #[test]
    fn strided_ndarray_views_come_to_the_host_in_row_major_order() {
        let device = Default::default();
        let base = Tensor::<B, 1>::from_data(
            TensorData::new((0..120).map(|i| i as f32 * 0.5 - 7.0).collect(), [120]),
            &device,
        )
        .reshape([2, 3, 5, 4]);
        let views = [
            base.clone().swap_dims(1, 2),
            base.clone().swap_dims(2, 3),
            base.clone().permute([3, 1, 0, 2]),
            base.clone().flip([2]),
        ];
        for (i, view) in views.into_iter().enumerate() {
            let want = view.clone().into_data();
            let primitive = view.into_primitive().tensor();
            assert!(
                ndarray_slice(&primitive).is_none(),
                "view {i}: standard layout"
            );
            let copy = ndarray_copy(&primitive).expect("an f32 tensor");
            let host = to_host::<B>(primitive);
            for got in [copy, host] {
                assert!(
                    matches!(got.data, HostData::Owned(_)),
                    "view {i}: not a copy"
                );
                assert_eq!(got.shape, want.shape.to_vec(), "view {i}: shape");
                assert_eq!(
                    &got.data[..],
                    want.as_slice::<f32>().expect("f32"),
                    "view {i}: values"
                );
            }
        }
    }
}
