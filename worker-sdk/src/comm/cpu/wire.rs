//! The wire format of one operation: the header every rank sends every other before the
//! data (kind, reduce op, root, dtype, lengths), and the shape comparison that names a
//! mismatched rank.

use crate::Error;
use crate::comm::{DType, ReduceOp};

use super::{HEADER_BYTES, HEADER_MAGIC, MAX_PAYLOAD, TRANSPORT_ENV};

/// [`TRANSPORT_ENV`], parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Transport {
    Auto,
    Shm,
    Cma,
    Unix,
    Tcp,
}

impl Transport {
    pub(super) fn from_env() -> Result<Self, Error> {
        match std::env::var(TRANSPORT_ENV) {
            Err(_) => Ok(Transport::Auto),
            Ok(v) => match v.as_str() {
                "" | "auto" => Ok(Transport::Auto),
                "shm" => Ok(Transport::Shm),
                "cma" => Ok(Transport::Cma),
                "unix" => Ok(Transport::Unix),
                "tcp" => Ok(Transport::Tcp),
                _ => Err(Error::Config(format!(
                    "{TRANSPORT_ENV}='{v}' is not a transport (use auto, shm, cma, unix or tcp)"
                ))),
            },
        }
    }
}

/// The operations, as headers carry them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Kind {
    AllReduce = 1,
    Broadcast = 2,
    Reduce = 3,
    AllGather = 4,
    ReduceScatter = 5,
    Send = 6,
    Barrier = 7,
}

impl Kind {
    pub(super) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Kind::AllReduce,
            2 => Kind::Broadcast,
            3 => Kind::Reduce,
            4 => Kind::AllGather,
            5 => Kind::ReduceScatter,
            6 => Kind::Send,
            7 => Kind::Barrier,
            _ => return None,
        })
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Send => "send",
            Kind::Barrier => "barrier",
        }
    }
}

pub(super) fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Avg => 2,
        ReduceOp::Min => 3,
        ReduceOp::Max => 4,
        ReduceOp::Product => 5,
    }
}

pub(super) fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 1,
        DType::F64 => 2,
        DType::F16 => 3,
        DType::BF16 => 4,
        DType::I32 => 5,
        DType::I64 => 6,
        DType::U8 => 7,
    }
}

pub(super) fn dtype_from(code: u8) -> Option<DType> {
    Some(match code {
        1 => DType::F32,
        2 => DType::F64,
        3 => DType::F16,
        4 => DType::BF16,
        5 => DType::I32,
        6 => DType::I64,
        7 => DType::U8,
        _ => return None,
    })
}

/// What every rank says about an operation before any data moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) kind: Kind,
    /// Reduce op code, 0 when none.
    pub(super) op: u8,
    pub(super) dtype: DType,
    pub(super) root: u32,
    pub(super) seq: u64,
    pub(super) count: u64,
    /// Bytes that follow this header on this connection.
    pub(super) payload: u64,
}

impl Header {
    pub(super) fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.op;
        b[6] = dtype_code(self.dtype);
        b[8..12].copy_from_slice(&self.root.to_le_bytes());
        b[12..20].copy_from_slice(&self.seq.to_le_bytes());
        b[20..28].copy_from_slice(&self.count.to_le_bytes());
        b[28..36].copy_from_slice(&self.payload.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8; HEADER_BYTES]) -> Option<Self> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        if u32_at(0) != HEADER_MAGIC {
            return None;
        }
        let header = Header {
            kind: Kind::from_u8(b[4])?,
            op: b[5],
            dtype: dtype_from(b[6])?,
            root: u32_at(8),
            seq: u64_at(12),
            count: u64_at(20),
            payload: u64_at(28),
        };
        (header.payload <= MAX_PAYLOAD).then_some(header)
    }

    /// Whether two ranks' headers describe the same operation (payload lengths may differ).
    pub(super) fn agrees(&self, other: &Header) -> bool {
        (
            self.kind, self.op, self.dtype, self.root, self.seq, self.count,
        ) == (
            other.kind,
            other.op,
            other.dtype,
            other.root,
            other.seq,
            other.count,
        )
    }

    pub(super) fn describe(&self) -> String {
        format!("{} of {} {}", self.kind.name(), self.count, self.dtype)
    }
}

/// "N dtype" for each rank, with whatever else differs (operation, root, reduce op, sequence).
pub(super) fn shapes(headers: &[Header]) -> Vec<(u32, String)> {
    let first = headers[0];
    let differs = |f: &dyn Fn(&Header) -> u64| headers.iter().any(|h| f(h) != f(&first));
    let kind = differs(&|h| h.kind as u64);
    let root = differs(&|h| u64::from(h.root));
    let op = differs(&|h| u64::from(h.op));
    let seq = differs(&|h| h.seq);
    headers
        .iter()
        .enumerate()
        .map(|(rank, h)| {
            let mut s = if kind {
                format!("{} of {} {}", h.kind.name(), h.count, h.dtype)
            } else {
                format!("{} {}", h.count, h.dtype)
            };
            if root {
                s.push_str(&format!(" root {}", h.root));
            }
            if op {
                s.push_str(&format!(" op {}", op_name(h.op)));
            }
            if seq {
                s.push_str(&format!(" (collective #{})", h.seq));
            }
            (rank as u32, s)
        })
        .collect()
}

pub(super) fn op_name(code: u8) -> &'static str {
    match code {
        1 => "sum",
        2 => "avg",
        3 => "min",
        4 => "max",
        5 => "product",
        _ => "none",
    }
}
