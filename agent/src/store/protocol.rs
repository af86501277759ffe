//! PyTorch's TCPStore wire protocol as its client (`torch.distributed.TCPStore`, PyTorch 2.x)
//! speaks it: parsing requests from a byte buffer and encoding replies, with no I/O, so every
//! rule is unit-tested here and the server (`server.rs`) only moves bytes.
//!
//! The format (read from PyTorch's `TCPStoreBackend.hpp`, `TCPStoreLibUvBackend.cpp` and
//! `TCPStore.cpp`): every request is one query-type byte followed by its fields, all in the
//! machine's byte order (little-endian on every platform torch ships for); a string or byte
//! vector is a `u64` length then the bytes; a key count is a `u64`. A connection must open with
//! `VALIDATE` and the magic number `0x3C85F7CE`; torch's client then sends `PING` with a nonce
//! that the server echoes. Replies carry no header: a `u8`, an `i64`, a `u32` or a byte vector,
//! depending on the request; `SET`, `APPEND`, `MULTI_SET` and `QUEUE_PUSH` get none.

use std::fmt;

/// The magic number a TCPStore client sends in its `VALIDATE` request.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// The longest key accepted on the wire, torch's libuv server's (`MAX_KEY_LEN`): 8 KiB with
/// the `/` its client puts before every key. Beyond, the connection is closed, as torch's
/// server closes it; the coordinator takes keys this long with the agent's prefix
/// (`muster_core::model::MAX_KV_KEY_BYTES`).
pub const MAX_KEY_BYTES: u64 = 8 * 1024;
/// The largest value accepted on the wire, torch's libuv server's (`MAX_STRING_LEN`): 8 MiB.
/// The coordinator's `max_value_bytes` is as large by default.
pub const MAX_VALUE_BYTES: u64 = 8 * 1024 * 1024;
/// The most keys in one `CHECK`, `WAIT`, `MULTI_GET` or `MULTI_SET` (torch's `MAX_KEY_COUNT`).
pub const MAX_KEY_COUNT: u64 = 128 * 1024;

/// `CheckResponseType::READY` / `NOT_READY`.
pub const CHECK_READY: u8 = 0;
pub const CHECK_NOT_READY: u8 = 1;
/// `WaitResponseType::STOP_WAITING` / `WAIT_CANCELED`.
pub const STOP_WAITING: u8 = 0;
pub const WAIT_CANCELED: u8 = 1;

/// Query types, in the order of torch's `QueryType` enum (the byte is the index).
mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
    pub const QUEUE_PUSH: u8 = 14;
    pub const QUEUE_POP: u8 = 15;
    pub const QUEUE_LEN: u8 = 16;
    pub const LIST_KEYS: u8 = 17;
    pub const BARRIER: u8 = 18;
}

/// One request of a validated connection (or the validation itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// The handshake, already checked: the magic number was right.
    Validate,
    Ping {
        nonce: u32,
    },
    Set {
        key: String,
        value: Vec<u8>,
    },
    CompareSet {
        key: String,
        expected: Vec<u8>,
        desired: Vec<u8>,
    },
    Get {
        key: String,
    },
    Add {
        key: String,
        delta: i64,
    },
    Check {
        keys: Vec<String>,
    },
    Wait {
        keys: Vec<String>,
    },
    NumKeys,
    DeleteKey {
        key: String,
    },
    Append {
        key: String,
        value: Vec<u8>,
    },
    MultiGet {
        keys: Vec<String>,
    },
    MultiSet {
        pairs: Vec<(String, Vec<u8>)>,
    },
    CancelWait,
    QueuePush {
        key: String,
        value: Vec<u8>,
    },
    QueuePop {
        key: String,
    },
    QueueLen {
        key: String,
    },
    ListKeys,
    Barrier {
        key: String,
        world_size: i64,
    },
}

impl Request {
    /// A write torch's client sends without waiting for a reply (`set`, `append`,
    /// `multi_set`, `queue_push`): to its caller it is done once sent.
    pub fn is_unanswered_write(&self) -> bool {
        matches!(
            self,
            Request::Set { .. }
                | Request::Append { .. }
                | Request::MultiSet { .. }
                | Request::QueuePush { .. }
        )
    }
}

/// Why a connection is closed: the client does not speak this protocol (or this version of
/// it). The text is what the agent logs and writes back before closing, so it names what was
/// expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProtocolError {
    /// The first request was not `VALIDATE`.
    NotValidated { query: u8 },
    /// `VALIDATE` with another magic number.
    BadMagic { got: u32 },
    /// A query type this protocol version does not have.
    UnknownQuery { query: u8 },
    /// A length or count beyond the limits above.
    TooLarge {
        what: &'static str,
        len: u64,
        max: u64,
    },
    /// A key that is not UTF-8 (the coordinator's keys are strings).
    KeyNotUtf8,
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotValidated { query } => write!(
                f,
                "muster agent store: expected the TCPStore client handshake first (query type 0, \
                 VALIDATE, then magic 0x{VALIDATION_MAGIC:08X}, as torch.distributed.TCPStore of \
                 PyTorch 2.x sends); got query type {query}"
            ),
            Self::BadMagic { got } => write!(
                f,
                "muster agent store: bad TCPStore validation magic 0x{got:08X}; expected \
                 0x{VALIDATION_MAGIC:08X} (torch.distributed.TCPStore of PyTorch 2.x); another \
                 protocol or protocol version is not served"
            ),
            Self::UnknownQuery { query } => write!(
                f,
                "muster agent store: unknown TCPStore query type {query}; this agent speaks \
                 PyTorch 2.x's protocol (query types 0 to {})",
                query::BARRIER
            ),
            Self::TooLarge { what, len, max } => write!(
                f,
                "muster agent store: {what} of {len} is over the limit of {max}"
            ),
            Self::KeyNotUtf8 => write!(f, "muster agent store: a key is not valid UTF-8"),
        }
    }
}

impl std::error::Error for ProtocolError {}

/// Reads fields from the front of a buffer; `None` means "not all here yet".
struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let bytes = self.buf.get(self.at..end)?;
        self.at = end;
        Some(bytes)
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn i64(&mut self) -> Option<i64> {
        Some(i64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// The result of reading one field: the outer `Result` is a protocol error, the `Option`
/// whether the field is complete.
type Field<T> = Result<Option<T>, ProtocolError>;

fn bytes(c: &mut Cursor<'_>, what: &'static str, max: u64) -> Field<Vec<u8>> {
    let Some(len) = c.u64() else { return Ok(None) };
    if len > max {
        return Err(ProtocolError::TooLarge { what, len, max });
    }
    // `len <= max` fits a usize on every platform the agent builds for.
    Ok(c.take(len as usize).map(<[u8]>::to_vec))
}

fn key(c: &mut Cursor<'_>) -> Field<String> {
    match bytes(c, "a key's length", MAX_KEY_BYTES)? {
        None => Ok(None),
        Some(raw) => String::from_utf8(raw)
            .map(Some)
            .map_err(|_| ProtocolError::KeyNotUtf8),
    }
}

fn value(c: &mut Cursor<'_>) -> Field<Vec<u8>> {
    bytes(c, "a value's length", MAX_VALUE_BYTES)
}

fn count(c: &mut Cursor<'_>) -> Field<u64> {
    let Some(n) = c.u64() else { return Ok(None) };
    if n > MAX_KEY_COUNT {
        return Err(ProtocolError::TooLarge {
            what: "a key count",
            len: n,
            max: MAX_KEY_COUNT,
        });
    }
    Ok(Some(n))
}

fn keys(c: &mut Cursor<'_>) -> Field<Vec<String>> {
    let Some(n) = count(c)? else { return Ok(None) };
    let mut keys = Vec::new();
    for _ in 0..n {
        let Some(k) = key(c)? else { return Ok(None) };
        keys.push(k);
    }
    Ok(Some(keys))
}

/// Unwraps a [`Field`], returning "incomplete" from the enclosing parser.
macro_rules! field {
    ($e:expr) => {
        match $e? {
            Some(v) => v,
            None => return Ok(None),
        }
    };
}

/// Parses the request at the front of `buf`. `validated` says whether the connection has
/// passed the handshake: until it has, only `VALIDATE` with the right magic is accepted.
/// Returns the request and how many bytes it took, `Ok(None)` when more bytes are needed, or
/// the error that must close the connection. A parse that needs more bytes consumes nothing,
/// so the caller keeps the buffer and calls again after the next read.
pub fn parse(buf: &[u8], validated: bool) -> Result<Option<(Request, usize)>, ProtocolError> {
    let mut c = Cursor { buf, at: 0 };
    let Some(query) = c.u8() else { return Ok(None) };
    if !validated && query != query::VALIDATE {
        return Err(ProtocolError::NotValidated { query });
    }
    let request = match query {
        query::VALIDATE => {
            let Some(got) = c.u32() else { return Ok(None) };
            if got != VALIDATION_MAGIC {
                return Err(ProtocolError::BadMagic { got });
            }
            Request::Validate
        }
        query::PING => Request::Ping {
            nonce: field!(Ok::<_, ProtocolError>(c.u32())),
        },
        query::SET => Request::Set {
            key: field!(key(&mut c)),
            value: field!(value(&mut c)),
        },
        query::COMPARE_SET => Request::CompareSet {
            key: field!(key(&mut c)),
            expected: field!(value(&mut c)),
            desired: field!(value(&mut c)),
        },
        query::GET => Request::Get {
            key: field!(key(&mut c)),
        },
        query::ADD => Request::Add {
            key: field!(key(&mut c)),
            delta: field!(Ok::<_, ProtocolError>(c.i64())),
        },
        query::CHECK => Request::Check {
            keys: field!(keys(&mut c)),
        },
        query::WAIT => Request::Wait {
            keys: field!(keys(&mut c)),
        },
        query::GETNUMKEYS => Request::NumKeys,
        query::DELETE_KEY => Request::DeleteKey {
            key: field!(key(&mut c)),
        },
        query::APPEND => Request::Append {
            key: field!(key(&mut c)),
            value: field!(value(&mut c)),
        },
        query::MULTI_GET => Request::MultiGet {
            keys: field!(keys(&mut c)),
        },
        query::MULTI_SET => {
            let n = field!(count(&mut c));
            let mut pairs = Vec::new();
            for _ in 0..n {
                let k = field!(key(&mut c));
                let v = field!(value(&mut c));
                pairs.push((k, v));
            }
            Request::MultiSet { pairs }
        }
        query::CANCEL_WAIT => Request::CancelWait,
        query::QUEUE_PUSH => Request::QueuePush {
            key: field!(key(&mut c)),
            value: field!(value(&mut c)),
        },
        query::QUEUE_POP => Request::QueuePop {
            key: field!(key(&mut c)),
        },
        query::QUEUE_LEN => Request::QueueLen {
            key: field!(key(&mut c)),
        },
        query::LIST_KEYS => Request::ListKeys,
        query::BARRIER => Request::Barrier {
            key: field!(key(&mut c)),
            world_size: field!(Ok::<_, ProtocolError>(c.i64())),
        },
        other => return Err(ProtocolError::UnknownQuery { query: other }),
    };
    Ok(Some((request, c.at)))
}

/// Appends a byte vector reply (`u64` length, then the bytes).
pub fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Appends an `i64` reply (counters, key counts, `DELETE_KEY`'s count).
pub fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a `u32` reply (`PING`'s nonce).
pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Builds requests the way torch's client does (`SendBuffer`).
    struct Req(Vec<u8>);
    impl Req {
        fn new(q: u8) -> Self {
            Self(vec![q])
        }
        fn s(mut self, v: &[u8]) -> Self {
            put_bytes(&mut self.0, v);
            self
        }
        fn n(mut self, v: u64) -> Self {
            self.0.extend_from_slice(&v.to_le_bytes());
            self
        }
        fn u32(mut self, v: u32) -> Self {
            put_u32(&mut self.0, v);
            self
        }
    }

    fn check(bytes: &[u8], expected: Request) {
        let (got, used) = parse(bytes, true).unwrap().unwrap();
        assert_eq!(got, expected);
        assert_eq!(used, bytes.len());
        // Every strict prefix is incomplete, never an error and never a request.
        for cut in 0..bytes.len() {
            assert_eq!(
                parse(&bytes[..cut], true),
                Ok(None),
                "prefix of {cut} bytes"
            );
        }
    }

    #[test]
    fn parses_every_query_torch_sends() {
        let k = |s: &str| s.to_owned();
        check(&Req::new(0).u32(VALIDATION_MAGIC).0, Request::Validate);
        check(&Req::new(13).u32(7).0, Request::Ping { nonce: 7 });
        check(
            &Req::new(1).s(b"/k").s(b"v").0,
            Request::Set {
                key: k("/k"),
                value: b"v".to_vec(),
            },
        );
        check(
            &Req::new(2).s(b"k").s(b"").s(b"d").0,
            Request::CompareSet {
                key: k("k"),
                expected: vec![],
                desired: b"d".to_vec(),
            },
        );
        check(&Req::new(3).s(b"k").0, Request::Get { key: k("k") });
        check(
            &Req::new(4).s(b"k").n((-3i64) as u64).0,
            Request::Add {
                key: k("k"),
                delta: -3,
            },
        );
        check(
            &Req::new(5).n(2).s(b"a").s(b"b").0,
            Request::Check {
                keys: vec![k("a"), k("b")],
            },
        );
        check(
            &Req::new(6).n(1).s(b"a").0,
            Request::Wait { keys: vec![k("a")] },
        );
        check(&Req::new(7).0, Request::NumKeys);
        check(&Req::new(8).s(b"k").0, Request::DeleteKey { key: k("k") });
        check(
            &Req::new(9).s(b"k").s(b"x").0,
            Request::Append {
                key: k("k"),
                value: b"x".to_vec(),
            },
        );
        check(
            &Req::new(10).n(1).s(b"a").0,
            Request::MultiGet { keys: vec![k("a")] },
        );
        check(
            &Req::new(11).n(2).s(b"a").s(b"1").s(b"b").s(b"2").0,
            Request::MultiSet {
                pairs: vec![(k("a"), b"1".to_vec()), (k("b"), b"2".to_vec())],
            },
        );
        check(&Req::new(12).0, Request::CancelWait);
        check(
            &Req::new(14).s(b"q").s(b"x").0,
            Request::QueuePush {
                key: k("q"),
                value: b"x".to_vec(),
            },
        );
        check(&Req::new(15).s(b"q").0, Request::QueuePop { key: k("q") });
        check(&Req::new(16).s(b"q").0, Request::QueueLen { key: k("q") });
        check(&Req::new(17).0, Request::ListKeys);
        check(
            &Req::new(18).s(b"b").n(4).0,
            Request::Barrier {
                key: k("b"),
                world_size: 4,
            },
        );
    }

    #[test]
    fn two_requests_in_one_buffer_parse_one_at_a_time() {
        let mut buf = Req::new(0).u32(VALIDATION_MAGIC).0;
        buf.extend(Req::new(13).u32(9).0);
        let (first, used) = parse(&buf, false).unwrap().unwrap();
        assert_eq!(first, Request::Validate);
        let (second, rest) = parse(&buf[used..], true).unwrap().unwrap();
        assert_eq!(second, Request::Ping { nonce: 9 });
        assert_eq!(used + rest, buf.len());
    }

    #[test]
    fn the_handshake_is_checked_and_named() {
        let e = parse(&Req::new(0).u32(0xDEAD_BEEF).0, false).unwrap_err();
        assert_eq!(e, ProtocolError::BadMagic { got: 0xDEAD_BEEF });
        assert!(e.to_string().contains("0x3C85F7CE"), "{e}");
        let e = parse(&Req::new(1).s(b"k").s(b"v").0, false).unwrap_err();
        assert_eq!(e, ProtocolError::NotValidated { query: 1 });
        assert!(e.to_string().contains("VALIDATE"), "{e}");
        // A validated connection does not validate again with a bad magic either.
        assert!(parse(&Req::new(0).u32(1).0, true).is_err());
    }

    #[test]
    fn unknown_queries_and_oversized_fields_are_refused_before_buffering() {
        let e = parse(&[200], true).unwrap_err();
        assert_eq!(e, ProtocolError::UnknownQuery { query: 200 });
        assert!(e.to_string().contains("query type 200"), "{e}");
        // A huge length is refused from its 8 bytes, not after reading that much.
        let e = parse(&Req::new(1).n(u64::MAX).0, true).unwrap_err();
        assert!(matches!(e, ProtocolError::TooLarge { .. }), "{e}");
        let e = parse(&Req::new(5).n(MAX_KEY_COUNT + 1).0, true).unwrap_err();
        assert!(matches!(e, ProtocolError::TooLarge { .. }), "{e}");
        assert_eq!(
            parse(&Req::new(3).s(&[0xff, 0xfe]).0, true),
            Err(ProtocolError::KeyNotUtf8)
        );
    }

    #[test]
    fn replies_are_little_endian_with_u64_lengths() {
        let mut out = Vec::new();
        put_bytes(&mut out, b"ab");
        put_i64(&mut out, -1);
        put_u32(&mut out, 0x0102_0304);
        assert_eq!(
            out,
            [
                2, 0, 0, 0, 0, 0, 0, 0, b'a', b'b', 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                4, 3, 2, 1
            ]
        );
    }
}
