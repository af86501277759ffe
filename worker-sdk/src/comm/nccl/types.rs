//! How muster's element types and reduce ops map onto NCCL's, and the integer mean NCCL
//! lacks (a sum, then a division on the host).

use cudarc::nccl::sys;

use crate::comm::{DType, ReduceOp};

/// The NCCL data type of a [`DType`].
pub(super) fn nccl_type(dtype: DType) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as T;
    match dtype {
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::U8 => T::ncclUint8,
    }
}

pub(super) fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

/// The NCCL operation for `op` on `dtype`, and whether the result must still be divided by the
/// world size on the host: NCCL's `ncclAvg` is for floats, so an integer mean is a sum followed
/// by a truncating division, as the CPU backend does.
pub(super) fn nccl_op(dtype: DType, op: ReduceOp) -> (sys::ncclRedOp_t, bool) {
    use sys::ncclRedOp_t as O;
    match op {
        ReduceOp::Sum => (O::ncclSum, false),
        ReduceOp::Product => (O::ncclProd, false),
        ReduceOp::Min => (O::ncclMin, false),
        ReduceOp::Max => (O::ncclMax, false),
        ReduceOp::Avg if is_float(dtype) => (O::ncclAvg, false),
        ReduceOp::Avg => (O::ncclSum, true),
    }
}

/// Divides every integer element of `buf` by `world_size`, truncating toward zero.
pub(super) fn divide_integers(buf: &mut [u8], dtype: DType, world_size: usize) {
    match dtype {
        DType::I32 => {
            let divisor = i32::try_from(world_size).unwrap_or(i32::MAX);
            for chunk in buf.chunks_exact_mut(4) {
                let value = i32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                chunk.copy_from_slice(&(value / divisor).to_ne_bytes());
            }
        }
        DType::I64 => {
            let divisor = i64::try_from(world_size).unwrap_or(i64::MAX);
            for chunk in buf.chunks_exact_mut(8) {
                let mut bytes = [0; 8];
                bytes.copy_from_slice(chunk);
                chunk.copy_from_slice(&(i64::from_ne_bytes(bytes) / divisor).to_ne_bytes());
            }
        }
        DType::U8 => {
            let divisor = u8::try_from(world_size).unwrap_or(u8::MAX);
            for byte in buf {
                *byte /= divisor;
            }
        }
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {}
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::super::version_name;
    use super::*;

    #[test]
    fn integer_means_truncate_toward_zero() {
        let mut buf: Vec<u8> = [7i32, -7, 9, 0]
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        divide_integers(&mut buf, DType::I32, 2);
        let got: Vec<i32> = buf
            .chunks_exact(4)
            .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got, [3, -3, 4, 0]);

        let mut buf: Vec<u8> = [-10i64, 11].iter().flat_map(|v| v.to_ne_bytes()).collect();
        divide_integers(&mut buf, DType::I64, 3);
        assert_eq!(&buf[..8], &(-3i64).to_ne_bytes());
        assert_eq!(&buf[8..], &3i64.to_ne_bytes());

        let mut buf = vec![255u8, 4];
        divide_integers(&mut buf, DType::U8, 4);
        assert_eq!(buf, [63, 1]);
    }

    #[test]
    fn averages_use_ncclavg_only_for_floats() {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            assert_eq!(
                nccl_op(dtype, ReduceOp::Avg),
                (sys::ncclRedOp_t::ncclAvg, false)
            );
        }
        for dtype in [DType::I32, DType::I64, DType::U8] {
            assert_eq!(
                nccl_op(dtype, ReduceOp::Avg),
                (sys::ncclRedOp_t::ncclSum, true)
            );
            assert_eq!(
                nccl_op(dtype, ReduceOp::Max),
                (sys::ncclRedOp_t::ncclMax, false)
            );
        }
        assert_eq!(nccl_type(DType::BF16), sys::ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_type(DType::F16), sys::ncclDataType_t::ncclFloat16);
        assert_eq!(nccl_type(DType::U8), sys::ncclDataType_t::ncclUint8);
        assert_eq!(version_name(22_105), "2.21.5");
        assert_eq!(version_name(2_804), "2.8.4");
    }
}
