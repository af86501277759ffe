//! Collectives between the ranks of a job: one communicator API over a CPU backend and NCCL.
//!
//! [`Element`] is every type a collective moves (f32, f64, f16, bf16, i32, i64, u8); backends
//! see byte buffers plus a [`DType`], through the crate-internal [`Backend`] trait, so that one
//! generic API serves every type without `unsafe` (the casts are `bytemuck`'s).

use std::fmt;

use crate::Error;

/// The element types a collective can move, as backends see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit IEEE float (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Unsigned byte.
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// The short name error messages use ("f32").
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A type collectives can move: plain old data with a [`DType`].
pub trait Element: bytemuck::Pod + Send + Sync + fmt::Debug + PartialEq + 'static {
    /// How backends see this type.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

/// How a reduction combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks (integer types divide with truncation).
    Avg,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
    /// Element-wise product.
    Product,
}

/// Which implementation carries a communicator's collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// Sockets between the processes (every machine).
    Cpu,
    /// NCCL on CUDA devices.
    Nccl,
}

impl BackendKind {
    /// "cpu" or "nccl", as `MUSTER_COMM_BACKEND` spells it.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Nccl => "nccl",
        }
    }
}

/// What a backend implements: equal-shape collectives over byte buffers. Everything else
/// (typed API, unequal sizes, padding, shape checks) is built on top in this module.
///
/// Buffers hold `len * dtype.size()` bytes, in the native layout of the element type. Every
/// rank calls the same operations in the same order with the same lengths, except where a
/// method says otherwise.
pub(crate) trait Backend: Send {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;
    /// In place: every rank ends with the reduction of every rank's `buf`.
    fn all_reduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), Error>;
    /// In place: every rank ends with `root`'s `buf`.
    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<(), Error>;
    /// In place on `root` (the other ranks' `buf` is unspecified afterwards).
    fn reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error>;
    /// `recv` (world_size times `send`'s length) ends with every rank's `send`, in rank order.
    fn all_gather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<(), Error>;
    /// `send` is world_size blocks of `recv`'s length; rank r's `recv` ends with the
    /// reduction of every rank's block r.
    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error>;
    /// Point to point: only this rank and `peer` take part.
    fn send(&mut self, buf: &[u8], peer: usize) -> Result<(), Error>;
    /// Point to point: receives exactly `buf.len()` bytes sent by `peer`.
    fn recv(&mut self, buf: &mut [u8], peer: usize) -> Result<(), Error>;
}
