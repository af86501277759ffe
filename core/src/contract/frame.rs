//! The node relay's framing: every message on the socket between a worker and its agent's relay
//! is a 4-byte little-endian body length followed by the prost-encoded body (`WorkerMessage`
//! towards the agent, `CoordinatorMessage` back). Pure functions over byte buffers: each side
//! keeps its own socket handling (a blocking `poll` loop in the SDK, a tokio reactor in the
//! agent) and both frame through these, so the two cannot disagree on a byte.

use prost::Message;

/// The largest frame body either side accepts: a peer that announces a bigger one is broken or
/// hostile, and the connection ends instead of buffering it.
pub const MAX_FRAME: usize = 64 * 1024;
/// The length prefix's size.
pub const HEADER_LEN: usize = 4;

/// Why the bytes at the start of a buffer are not a frame; either way the connection ends.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The length prefix announces a body over [`MAX_FRAME`] bytes (the announced length).
    #[error("a frame of {0} bytes (the limit is {MAX_FRAME})")]
    TooLarge(usize),
    /// The body is not a valid encoding of the expected message.
    #[error("a malformed frame: {0}")]
    Malformed(#[source] prost::DecodeError),
}

/// What the start of a buffer holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<T> {
    /// A whole frame: its body (or decoded message) and the bytes it took, prefix included.
    Complete {
        /// The body, or the message decoded from it.
        message: T,
        /// Bytes to consume from the buffer.
        len: usize,
    },
    /// Not yet a whole frame: the buffer must hold `needed` bytes (prefix included) before
    /// asking again; while the prefix itself is incomplete, that is the prefix's size.
    Partial {
        /// The frame's whole size, as far as it is known.
        needed: usize,
    },
}

/// Encodes `msg` as one frame into `out`, replacing what was there (so one buffer is reused
/// for every frame a connection sends).
pub fn encode(msg: &impl Message, out: &mut Vec<u8>) {
    out.clear();
    let len = msg.encoded_len();
    out.reserve(HEADER_LEN + len);
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
    msg.encode(out).expect("a Vec grows as needed");
}

/// The first frame at the start of `buf`, its body undecoded. Only the length is checked, so
/// an oversized frame is refused as soon as its prefix arrives.
pub fn split(buf: &[u8]) -> Result<Frame<&[u8]>, FrameError> {
    let Some(head) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(Frame::Partial { needed: HEADER_LEN });
    };
    let len = u32::from_le_bytes(*head) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let needed = HEADER_LEN + len;
    Ok(match buf.get(HEADER_LEN..needed) {
        Some(body) => Frame::Complete {
            message: body,
            len: needed,
        },
        None => Frame::Partial { needed },
    })
}

/// The first frame at the start of `buf`, decoded as an `M`.
pub fn decode<M: Message + Default>(buf: &[u8]) -> Result<Frame<M>, FrameError> {
    Ok(match split(buf)? {
        Frame::Complete { message, len } => Frame::Complete {
            message: M::decode(message).map_err(FrameError::Malformed)?,
            len,
        },
        Frame::Partial { needed } => Frame::Partial { needed },
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use muster_proto::v1::{self as pb, coordinator_message, worker_message};

    fn result(seq: u64, message_len: usize) -> pb::CoordinatorMessage {
        pb::CoordinatorMessage {
            kind: Some(coordinator_message::Kind::Barrier(pb::BarrierResult {
                scope: 1,
                seq,
                error: (message_len > 0).then(|| pb::BarrierError {
                    message: "x".repeat(message_len),
                    ..Default::default()
                }),
            })),
        }
    }

    fn wire(messages: &[pb::CoordinatorMessage]) -> Vec<u8> {
        let (mut wire, mut frame) = (Vec::new(), Vec::new());
        for m in messages {
            encode(m, &mut frame);
            wire.extend_from_slice(&frame);
        }
        wire
    }

    #[test]
    fn encode_writes_the_length_then_the_body() {
        let msg = result(7, 0);
        let mut out = vec![9; 100];
        encode(&msg, &mut out);
        let body = msg.encode_to_vec();
        assert_eq!(out[..4], (body.len() as u32).to_le_bytes());
        assert_eq!(out[4..], body[..], "the old content is replaced");
    }

    /// Frames run together and cut at every byte decode the same, and every prefix of a frame
    /// asks for exactly the bytes it lacks.
    #[test]
    fn frames_survive_any_split() {
        let messages = [result(1, 0), result(2, 5000), result(3, 3)];
        let wire = wire(&messages);
        let mut at = 0;
        for m in &messages {
            let Frame::Complete { message, len } =
                decode::<pb::CoordinatorMessage>(&wire[at..]).unwrap()
            else {
                panic!("a whole frame at {at}");
            };
            assert_eq!(&message, m);
            for cut in 0..len {
                let got = decode::<pb::CoordinatorMessage>(&wire[at..at + cut]).unwrap();
                let needed = if cut < HEADER_LEN { HEADER_LEN } else { len };
                assert_eq!(
                    got,
                    Frame::Partial { needed },
                    "frame at {at}, cut at {cut}"
                );
            }
            at += len;
        }
        assert_eq!(at, wire.len());
        assert_eq!(
            split(&wire[at..]).unwrap(),
            Frame::Partial { needed: HEADER_LEN }
        );
    }

    #[test]
    fn an_empty_body_is_the_default_message() {
        let got = decode::<pb::WorkerMessage>(&[0, 0, 0, 0, 0xff]).unwrap();
        assert_eq!(
            got,
            Frame::Complete {
                message: pb::WorkerMessage::default(),
                len: 4
            }
        );
        let mut out = Vec::new();
        encode(
            &pb::WorkerMessage {
                kind: Some(worker_message::Kind::Heartbeat(Default::default())),
            },
            &mut out,
        );
        assert!(matches!(
            decode::<pb::WorkerMessage>(&out).unwrap(),
            Frame::Complete { len, .. } if len == out.len()
        ));
    }

    /// An oversized frame is refused from its prefix alone, before its body arrives; the
    /// largest allowed one is waited for.
    #[test]
    fn oversized_frames_are_refused() {
        for len in [MAX_FRAME + 1, u32::MAX as usize] {
            let prefix = (len as u32).to_le_bytes();
            let got = split(&prefix);
            assert!(
                matches!(got, Err(FrameError::TooLarge(n)) if n == len),
                "{got:?}"
            );
            let text = decode::<pb::WorkerMessage>(&prefix)
                .unwrap_err()
                .to_string();
            assert_eq!(
                text,
                format!("a frame of {len} bytes (the limit is {MAX_FRAME})")
            );
        }
        let largest = (MAX_FRAME as u32).to_le_bytes();
        assert_eq!(
            split(&largest).unwrap(),
            Frame::Partial {
                needed: HEADER_LEN + MAX_FRAME
            }
        );
    }

    #[test]
    fn malformed_bodies_are_errors() {
        // Field 1 says 5 bytes follow, and 1 does; then a field number 0; then a bad wire type.
        for body in [&[0x0a, 0x05, 0x01][..], &[0x00], &[0x0f, 0x01]] {
            let mut frame = (body.len() as u32).to_le_bytes().to_vec();
            frame.extend_from_slice(body);
            // The body is framed correctly: only decoding it fails.
            assert!(matches!(split(&frame), Ok(Frame::Complete { .. })));
            let got = decode::<pb::WorkerMessage>(&frame);
            assert!(
                matches!(got, Err(FrameError::Malformed(_))),
                "{body:?}: {got:?}"
            );
        }
    }
}
