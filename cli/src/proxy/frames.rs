//! AMQP 0-9-1 frames as the proxy sees them, with `amq-protocol` (lapin's own codec): where a
//! frame ends in a byte buffer, the method or content header it carries, and the bytes of a
//! frame the proxy rewrote. Pure: no I/O. A frame the proxy does not rewrite is forwarded as
//! the bytes it arrived as, so only rewritten frames are ever encoded.

use amq_protocol::frame::parsing::{parse_content_header, parse_frame_type, parse_raw_frame};
use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, AMQPFrameType, WriteContext, gen_frame};
use amq_protocol::protocol::{AMQPClass, parse_class};
use amq_protocol::types::parsing::parse_id;

/// The AMQP protocol header a client opens with (`AMQP\0\0\x09\x01`).
pub const PROTOCOL_HEADER_LEN: usize = 8;

/// The longest frame accepted before `connection.tune-ok` names the negotiated `frame_max`
/// (the broker's default frame size).
pub const HANDSHAKE_FRAME_MAX: u32 = 131_072;

/// What the front of a buffer holds.
#[derive(Debug, PartialEq)]
pub enum Split<'a> {
    /// A whole frame of `len` bytes (header, payload and end octet).
    Frame(Raw<'a>),
    /// A protocol header (a broker refusing the client's version sends its own): `len` bytes.
    ProtocolHeader(usize),
    /// Not a whole frame yet: read more.
    Incomplete,
    /// Not AMQP: the connection cannot go on.
    Invalid(String),
}

/// One frame, unparsed: its kind, channel and payload, borrowed from the buffer.
#[derive(Debug, PartialEq)]
pub struct Raw<'a> {
    /// Method, content header, body or heartbeat.
    pub kind: AMQPFrameType,
    /// Its channel.
    pub channel: u16,
    /// Its payload (without the 7-byte frame header and the end octet).
    pub payload: &'a [u8],
    /// The whole frame's length in the buffer.
    pub len: usize,
    /// The whole frame's bytes, as they arrived.
    pub bytes: &'a [u8],
}

/// The frame at the front of `buf`, if it is whole.
pub fn split(buf: &[u8]) -> Split<'_> {
    let kind = match parse_frame_type(buf) {
        Ok((_, kind)) => kind,
        Err(e) if e.is_incomplete() => return Split::Incomplete,
        Err(_) => {
            let kind = buf.first().copied().unwrap_or_default();
            return Split::Invalid(format!("unknown frame type {kind}"));
        }
    };
    if kind == AMQPFrameType::ProtocolHeader {
        return if buf.len() < PROTOCOL_HEADER_LEN {
            Split::Incomplete
        } else {
            Split::ProtocolHeader(PROTOCOL_HEADER_LEN)
        };
    }
    match parse_raw_frame(kind)(&buf[1..]) {
        Ok((rest, raw)) => {
            let len = buf.len() - rest.len();
            Split::Frame(Raw {
                kind,
                channel: raw.channel_id,
                payload: raw.payload,
                len,
                bytes: &buf[..len],
            })
        }
        Err(e) if e.is_incomplete() => Split::Incomplete,
        Err(_) => Split::Invalid("a frame does not end with the frame-end octet".into()),
    }
}

/// A method's class and method ids (AMQP 0-9-1's numbers: `(60, 40)` is `basic.publish`).
pub type MethodId = (u16, u16);

/// The class and method ids a method frame's payload starts with, without parsing the rest:
/// the proxy parses only the methods it may rewrite or waits for, and passes every other one
/// (a broker's extension too) as it came.
pub fn method_id(payload: &[u8]) -> Option<MethodId> {
    let (rest, class) = parse_id(payload).ok()?;
    let (_, method) = parse_id(rest).ok()?;
    Some((class, method))
}

/// The method a method frame's payload carries.
pub fn method(payload: &[u8]) -> Result<AMQPClass, String> {
    match parse_class(payload) {
        Ok(([], m)) => Ok(m),
        Ok(_) => Err("a method frame has bytes after its method".into()),
        Err(_) => Err("a method frame does not parse".into()),
    }
}

/// The content header a header frame's payload carries.
pub fn content_header(payload: &[u8]) -> Result<AMQPContentHeader, String> {
    match parse_content_header(payload) {
        Ok(([], h)) => Ok(h),
        Ok(_) => Err("a content header frame has bytes after its properties".into()),
        Err(_) => Err("a content header frame does not parse".into()),
    }
}

/// The bytes of a method frame the proxy writes (a rewritten one, or its own close).
pub fn encode_method(channel: u16, method: AMQPClass) -> Result<Vec<u8>, String> {
    let frame = AMQPFrame::Method(channel, method);
    gen_frame(&frame)(WriteContext::from(Vec::new()))
        .map(|ctx| ctx.write)
        .map_err(|e| format!("encoding a rewritten frame: {e}"))
}

/// The bytes of a content header frame the proxy rewrote.
pub fn encode_header(channel: u16, header: AMQPContentHeader) -> Result<Vec<u8>, String> {
    let frame = AMQPFrame::Header(channel, header);
    gen_frame(&frame)(WriteContext::from(Vec::new()))
        .map(|ctx| ctx.write)
        .map_err(|e| format!("encoding a rewritten content header: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::{basic, exchange};

    fn publish_frame(exchange: &str) -> Vec<u8> {
        encode_method(
            3,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: exchange.into(),
                routing_key: "k".into(),
                mandatory: true,
                immediate: false,
            })),
        )
        .unwrap()
    }

    #[test]
    fn a_frame_is_found_only_when_whole() {
        let f = publish_frame("x");
        for n in 0..f.len() {
            assert_eq!(split(&f[..n]), Split::Incomplete, "{n} bytes");
        }
        let mut two = f.clone();
        two.extend_from_slice(&f);
        let Split::Frame(raw) = split(&two) else {
            panic!("no frame")
        };
        assert_eq!(
            (raw.kind, raw.channel, raw.len),
            (AMQPFrameType::Method, 3, f.len())
        );
        match method(raw.payload).unwrap() {
            AMQPClass::Basic(basic::AMQPMethod::Publish(p)) => {
                assert_eq!(p.exchange.as_str(), "x");
                assert!(p.mandatory);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn method_ids_are_read_without_parsing_the_method() {
        let f = publish_frame("x");
        let Split::Frame(raw) = split(&f) else {
            panic!("no frame")
        };
        let p = basic::Publish::default();
        assert_eq!(
            method_id(raw.payload),
            Some((p.get_amqp_class_id(), p.get_amqp_method_id()))
        );
        assert_eq!(method_id(&[0, 60, 0]), None);
    }

    #[test]
    fn garbage_is_refused_with_a_reason_not_a_panic() {
        assert!(matches!(
            split(&[9, 0, 0, 0, 0, 0, 0, 0]),
            Split::Invalid(_)
        ));
        // a method frame whose end octet is wrong
        let mut f = publish_frame("x");
        let last = f.len() - 1;
        f[last] = 0;
        assert!(matches!(split(&f), Split::Invalid(_)));
        assert!(method(&[0, 40]).is_err());
        assert!(method(&[0xff, 0xff, 0, 1, 2]).is_err());
        assert!(content_header(&[0, 60, 0]).is_err());
        assert_eq!(
            split(b"AMQP\x00\x00\x09\x01rest"),
            Split::ProtocolHeader(PROTOCOL_HEADER_LEN)
        );
    }

    #[test]
    fn a_rewritten_declare_round_trips() {
        let m = AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: "orders".into(),
            kind: "direct".into(),
            durable: true,
            ..Default::default()
        }));
        let bytes = encode_method(1, m.clone()).unwrap();
        let Split::Frame(raw) = split(&bytes) else {
            panic!("no frame")
        };
        assert_eq!(method(raw.payload).unwrap(), m);
    }
}
