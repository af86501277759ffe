//! Element-wise reduction kernels over byte buffers: `dst = dst (op) src` for every
//! [`DType`] and [`ReduceOp`], and the final division of [`ReduceOp::Avg`].
//!
//! Buffers are bytes because backends move bytes; when both slices are aligned for the element
//! type (always, for user buffers and the backends' scratch, which is allocated as `u64`s) the
//! kernels run over typed slices that the compiler vectorises; otherwise they fall back to
//! decoding each element (correct, slower). Integer sums and products wrap, like NCCL and
//! PyTorch (no overflow panic in debug builds). `f16` and `bf16` are reduced in `f32` and
//! rounded back per element, as NCCL does. `Avg` reduces as a sum; [`finish_avg`] divides once
//! at the end (integers truncate).

use half::{bf16, f16};

use super::{DType, ReduceOp};

/// `dst[i] = dst[i] (op) src[i]` for every element. Both slices hold whole elements and have the
/// same length. `Avg` adds (see [`finish_avg`]).
pub(crate) fn reduce_into(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    reduce_with::<false>(dst, src, dtype, op);
}

/// `dst[i] = src[i] (op) dst[i]`: [`reduce_into`] with the operands the other way round, so
/// that a rank can fold what came before it (`src`) into its own data (`dst`) in place and
/// still reduce in rank order (floating-point results depend on the order).
pub(crate) fn reduce_into_after(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    reduce_with::<true>(dst, src, dtype, op);
}

/// The kernels; `SRC_FIRST` puts `src` on the left of the operator.
fn reduce_with<const SRC_FIRST: bool>(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    debug_assert_eq!(dst.len(), src.len());
    debug_assert_eq!(dst.len() % dtype.size(), 0);
    match dtype {
        DType::F32 => typed::<f32>(dst, src, |d, s| float_kernel::<_, SRC_FIRST>(d, s, op)),
        DType::F64 => typed::<f64>(dst, src, |d, s| float_kernel::<_, SRC_FIRST>(d, s, op)),
        DType::I32 => typed::<i32>(dst, src, |d, s| int_kernel::<_, SRC_FIRST>(d, s, op)),
        DType::I64 => typed::<i64>(dst, src, |d, s| int_kernel::<_, SRC_FIRST>(d, s, op)),
        DType::U8 => int_kernel::<u8, SRC_FIRST>(dst, src, op),
        DType::F16 => typed::<f16>(dst, src, |d, s| half_kernel::<_, SRC_FIRST>(d, s, op)),
        DType::BF16 => typed::<bf16>(dst, src, |d, s| half_kernel::<_, SRC_FIRST>(d, s, op)),
    }
}

/// `f(d, s)`, or `f(s, d)` when `SRC_FIRST` (a constant, so the branch compiles away).
#[inline(always)]
fn ordered<T, const SRC_FIRST: bool>(d: T, s: T, f: impl Fn(T, T) -> T) -> T {
    if SRC_FIRST { f(s, d) } else { f(d, s) }
}

/// Divides every element by `n`: the end of an `Avg` reduction (integers truncate toward zero).
pub(crate) fn finish_avg(buf: &mut [u8], dtype: DType, n: usize) {
    match dtype {
        DType::F32 => map::<f32>(buf, |x| x / n as f32),
        DType::F64 => map::<f64>(buf, |x| x / n as f64),
        DType::F16 => map::<f16>(buf, |x| f16::from_f32(x.to_f32() / n as f32)),
        DType::BF16 => map::<bf16>(buf, |x| bf16::from_f32(x.to_f32() / n as f32)),
        DType::I32 => map::<i32>(buf, |x| x.wrapping_div(n as i32)),
        DType::I64 => map::<i64>(buf, |x| x.wrapping_div(n as i64)),
        DType::U8 => map::<u8>(buf, |x| (x as usize / n) as u8),
    }
}

/// Runs `kernel` over typed views when both slices are aligned, else over aligned copies.
fn typed<T: bytemuck::Pod>(dst: &mut [u8], src: &[u8], kernel: impl Fn(&mut [T], &[T])) {
    let aligned = |p: *const u8| p.align_offset(std::mem::align_of::<T>()) == 0;
    if aligned(dst.as_ptr()) && aligned(src.as_ptr()) {
        kernel(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
    } else {
        // Rare (only unaligned callers): decode, reduce, encode.
        let mut d: Vec<T> = bytemuck::pod_collect_to_vec(dst);
        let s: Vec<T> = bytemuck::pod_collect_to_vec(src);
        kernel(&mut d, &s);
        dst.copy_from_slice(bytemuck::cast_slice(&d));
    }
}

fn map<T: bytemuck::Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(b) => b.iter_mut().for_each(|x| *x = f(*x)),
        Err(_) => {
            let mut b: Vec<T> = bytemuck::pod_collect_to_vec(buf);
            b.iter_mut().for_each(|x| *x = f(*x));
            buf.copy_from_slice(bytemuck::cast_slice(&b));
        }
    }
}

/// Floats: the operators themselves (`min`/`max` ignore a NaN operand, like `f32::min`).
trait Float: Copy + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> {
    fn min(self, other: Self) -> Self;
    fn max(self, other: Self) -> Self;
}
impl Float for f32 {
    fn min(self, other: Self) -> Self {
        f32::min(self, other)
    }
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
}
impl Float for f64 {
    fn min(self, other: Self) -> Self {
        f64::min(self, other)
    }
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
}

fn float_kernel<T: Float, const SRC_FIRST: bool>(dst: &mut [T], src: &[T], op: ReduceOp) {
    let zip = dst.iter_mut().zip(src);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            zip.for_each(|(d, s)| *d = ordered::<_, SRC_FIRST>(*d, *s, |a, b| a + b))
        }
        ReduceOp::Product => {
            zip.for_each(|(d, s)| *d = ordered::<_, SRC_FIRST>(*d, *s, |a, b| a * b))
        }
        ReduceOp::Min => zip.for_each(|(d, s)| *d = ordered::<_, SRC_FIRST>(*d, *s, T::min)),
        ReduceOp::Max => zip.for_each(|(d, s)| *d = ordered::<_, SRC_FIRST>(*d, *s, T::max)),
    }
}

/// Integers: wrapping sum and product.
trait Int: Copy + Ord {
    fn wrapping_add(self, other: Self) -> Self;
    fn wrapping_mul(self, other: Self) -> Self;
}
macro_rules! int {
    ($($t:ty),*) => {$(
        impl Int for $t {
            fn wrapping_add(self, other: Self) -> Self {
                <$t>::wrapping_add(self, other)
            }
            fn wrapping_mul(self, other: Self) -> Self {
                <$t>::wrapping_mul(self, other)
            }
        }
    )*};
}
int!(i32, i64, u8);

fn int_kernel<T: Int, const SRC_FIRST: bool>(dst: &mut [T], src: &[T], op: ReduceOp) {
    let zip = dst.iter_mut().zip(src);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            zip.for_each(|(d, s)| *d = ordered::<_, SRC_FIRST>(*d, *s, T::wrapping_add))
        }
        ReduceOp::Product => {
            zip.for_each(|(d, s)| *d = ordered::<_, SRC_FIRST>(*d, *s, T::wrapping_mul))
        }
        ReduceOp::Min => zip.for_each(|(d, s)| *d = ordered::<_, SRC_FIRST>(*d, *s, Ord::min)),
        ReduceOp::Max => zip.for_each(|(d, s)| *d = ordered::<_, SRC_FIRST>(*d, *s, Ord::max)),
    }
}

/// 16-bit floats: each element through `f32` and rounded back.
trait Half: Copy {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}
impl Half for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
impl Half for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

fn half_kernel<T: Half, const SRC_FIRST: bool>(dst: &mut [T], src: &[T], op: ReduceOp) {
    let f: fn(f32, f32) -> f32 = match op {
        ReduceOp::Sum | ReduceOp::Avg => |a, b| a + b,
        ReduceOp::Product => |a, b| a * b,
        ReduceOp::Min => f32::min,
        ReduceOp::Max => f32::max,
    };
    dst.iter_mut().zip(src).for_each(|(d, s)| {
        *d = T::from_f32(ordered::<_, SRC_FIRST>(d.to_f32(), s.to_f32(), f));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_reduce_every_type() {
        let mut a = bytemuck::cast_slice::<i32, u8>(&[1, -2, i32::MAX]).to_vec();
        let b = bytemuck::cast_slice::<i32, u8>(&[3, 5, 1]).to_vec();
        reduce_into(&mut a, &b, DType::I32, ReduceOp::Sum);
        let got: Vec<i32> = bytemuck::pod_collect_to_vec(&a);
        assert_eq!(got, [4, 3, i32::MIN]);

        let mut a = vec![200u8, 3];
        reduce_into(&mut a, &[100, 9], DType::U8, ReduceOp::Max);
        assert_eq!(a, [200, 9]);
        finish_avg(&mut a, DType::U8, 2);
        assert_eq!(a, [100, 4]);

        let mut a: Vec<u8> = bytemuck::cast_slice(&[f16::from_f32(1.5)]).to_vec();
        let b: Vec<u8> = bytemuck::cast_slice(&[f16::from_f32(2.0)]).to_vec();
        reduce_into(&mut a, &b, DType::F16, ReduceOp::Product);
        let got: Vec<f16> = bytemuck::pod_collect_to_vec(&a);
        assert_eq!(got[0].to_f32(), 3.0);

        // Unaligned bytes take the slow path, with the same result (a `Vec`'s buffer is
        // aligned, so one byte in is not).
        #[allow(clippy::useless_vec)]
        let mut a = vec![0u8; 9];
        a[1..].copy_from_slice(bytemuck::cast_slice(&[1.5f32, -2.0]));
        let b: Vec<u8> = bytemuck::cast_slice(&[2.0f32, 3.0]).to_vec();
        reduce_into(&mut a[1..], &b, DType::F32, ReduceOp::Sum);
        let got: Vec<f32> = bytemuck::pod_collect_to_vec(&a[1..]);
        assert_eq!(got, [3.5, 1.0]);
    }

    #[test]
    fn the_reversed_kernel_puts_the_source_first() {
        // Float addition is not associative: (a + b) + c != a + (b + c) here, so the order of
        // the operands shows. `reduce_into_after(c, a + b)` must give (a + b) + c.
        let (a, b, c) = (1e20f64, -1e20f64, 1.0f64);
        let ab = a + b;
        let mut dst: Vec<u8> = bytemuck::cast_slice(&[c]).to_vec();
        reduce_into_after(
            &mut dst,
            bytemuck::cast_slice(&[ab]),
            DType::F64,
            ReduceOp::Sum,
        );
        assert_eq!(bytemuck::pod_collect_to_vec::<u8, f64>(&dst), [ab + c]);
        // Min of -0.0 and +0.0 may depend on the order; both kernels agree with their order.
        for op in [
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Product,
            ReduceOp::Sum,
        ] {
            for dtype in [DType::F32, DType::I32, DType::BF16] {
                let x: Vec<u8> = match dtype {
                    DType::F32 => bytemuck::cast_slice(&[1.5f32, -0.0, 3.0]).to_vec(),
                    DType::I32 => bytemuck::cast_slice(&[7i32, -3, 0]).to_vec(),
                    _ => bytemuck::cast_slice(&[bf16::from_f32(2.0); 6]).to_vec(),
                };
                let y: Vec<u8> = match dtype {
                    DType::F32 => bytemuck::cast_slice(&[-2.0f32, 0.0, 3.5]).to_vec(),
                    DType::I32 => bytemuck::cast_slice(&[1i32, 9, -4]).to_vec(),
                    _ => bytemuck::cast_slice(&[bf16::from_f32(-1.0); 6]).to_vec(),
                };
                let mut forward = x.clone();
                reduce_into(&mut forward, &y, dtype, op);
                let mut after = y.clone();
                reduce_into_after(&mut after, &x, dtype, op);
                assert_eq!(forward, after, "{dtype} {op:?}");
            }
        }
    }
}
