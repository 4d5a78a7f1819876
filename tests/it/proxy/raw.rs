//! A client of a few hand-made frames, for what no AMQP library sends: several methods in one
//! TCP write, frames before the login, a forged `tune-ok`. Frames are made and read with the
//! proxy's own codec (`amqp_delay_cli::proxy::frames`).

use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, channel, connection, exchange};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use amqp_delay_cli::proxy::frames::{self, Split};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The AMQP 0-9-1 protocol header.
pub(super) const PROTOCOL_HEADER: &[u8] = b"AMQP\x00\x00\x09\x01";

/// A method frame's bytes.
pub(super) fn method(channel: u16, m: AMQPClass) -> Vec<u8> {
    frames::encode_method(channel, m).expect("encoding a test frame")
}

/// A `connection.tune-ok` asking for `frame_max` (and RabbitMQ's default `channel_max`).
pub(super) fn tune_ok(frame_max: u32) -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 2047,
            frame_max,
            heartbeat: 0,
        })),
    )
}

/// `exchange.declare` of `x` of type `kind` (`passive` or not, durable), with `args`.
pub(super) fn declare(
    channel: u16,
    x: &str,
    kind: &str,
    passive: bool,
    args: FieldTable,
) -> Vec<u8> {
    method(
        channel,
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: x.into(),
            kind: kind.into(),
            passive,
            durable: true,
            arguments: args,
            ..Default::default()
        })),
    )
}

/// An `x-delayed-message` declare of `x` whose real type is `kind`.
pub(super) fn delayed_declare(channel: u16, x: &str, kind: &str) -> Vec<u8> {
    let mut args = FieldTable::default();
    args.insert(
        "x-delayed-type".into(),
        AMQPValue::LongString(LongString::from(kind)),
    );
    declare(channel, x, "x-delayed-message", false, args)
}

/// `exchange.delete` of `x`.
pub(super) fn delete(channel: u16, x: &str) -> Vec<u8> {
    method(
        channel,
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: x.into(),
            if_unused: false,
            nowait: false,
        })),
    )
}

/// `basic.publish` to `x` (no content header follows in these tests).
pub(super) fn publish(channel: u16, x: &str) -> Vec<u8> {
    method(
        channel,
        AMQPClass::Basic(amq_protocol::protocol::basic::AMQPMethod::Publish(
            amq_protocol::protocol::basic::Publish {
                exchange: x.into(),
                routing_key: "k".into(),
                mandatory: false,
                immediate: false,
            },
        )),
    )
}

/// A connection of hand-made frames.
pub(super) struct RawClient {
    s: TcpStream,
    buf: Vec<u8>,
}

impl RawClient {
    /// Connects to `port` on 127.0.0.1.
    pub(super) async fn connect(port: u16) -> RawClient {
        let s = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connecting to delay-proxy");
        RawClient { s, buf: Vec::new() }
    }

    /// Logs in with PLAIN as `user`:`password` and opens `vhost` (the frames as a library
    /// sends them, the tune-ok asking for `frame_max`).
    pub(super) async fn login(
        port: u16,
        user: &str,
        password: &str,
        vhost: &str,
        frame_max: u32,
    ) -> Self {
        let mut c = RawClient::connect(port).await;
        c.send(PROTOCOL_HEADER).await.expect("sending the header");
        c.expect_method("connection.start", |m| {
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::Start(_)))
        })
        .await;
        let start_ok = connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: format!("\0{user}\0{password}").into(),
            locale: "en_US".into(),
        };
        let start_ok = method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
        );
        c.send(&start_ok).await.expect("sending start-ok");
        c.expect_method("connection.tune", |m| {
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::Tune(_)))
        })
        .await;
        let open = connection::Open {
            virtual_host: vhost.into(),
        };
        let mut out = tune_ok(frame_max);
        out.extend(method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(open)),
        ));
        c.send(&out).await.expect("sending tune-ok and open");
        c.expect_method("connection.open-ok", |m| {
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)))
        })
        .await;
        c
    }

    /// Opens `channel`.
    pub(super) async fn open_channel(&mut self, channel: u16) {
        let open = method(
            channel,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        );
        self.send(&open).await.expect("sending channel.open");
        self.expect_method("channel.open-ok", |m| {
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))
        })
        .await;
    }

    /// Writes `bytes` in one write.
    pub(super) async fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.s.write_all(bytes).await
    }

    /// The next method the proxy sends (other frames are skipped), with its channel; `None`
    /// when the connection ends.
    pub(super) async fn next_method(&mut self) -> Option<(u16, AMQPClass)> {
        loop {
            match frames::split(&self.buf) {
                Split::Frame(raw) => {
                    let (len, channel) = (raw.len, raw.channel);
                    let m = (raw.kind == amq_protocol::frame::AMQPFrameType::Method)
                        .then(|| frames::method(raw.payload).expect("a method the proxy sent"));
                    self.buf.drain(..len);
                    if let Some(m) = m {
                        return Some((channel, m));
                    }
                }
                Split::ProtocolHeader(n) => {
                    self.buf.drain(..n);
                }
                Split::Incomplete => {
                    let mut chunk = vec![0u8; 64 * 1024];
                    let read =
                        tokio::time::timeout(Duration::from_secs(30), self.s.read(&mut chunk))
                            .await
                            .expect("the proxy sent nothing for 30 s");
                    match read {
                        Ok(0) | Err(_) => return None,
                        Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                    }
                }
                Split::Invalid(e) => panic!("the proxy sent garbage: {e}"),
            }
        }
    }

    /// The next method, which must be `what` (`is` says whether it is).
    pub(super) async fn expect_method(
        &mut self,
        what: &str,
        is: impl Fn(&AMQPClass) -> bool,
    ) -> u16 {
        match self.next_method().await {
            Some((channel, m)) if is(&m) => channel,
            other => panic!("expected {what}, got {other:?}"),
        }
    }
}
