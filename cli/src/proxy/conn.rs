//! One client connection: an upstream TCP connection of its own to the broker, and a pump per
//! direction. Each pump reads whole frames into a buffer of at most one frame and writes what it
//! read before it reads again, so a slow reader on one side stops the other side's reads (TCP
//! backpressure). Until the broker's `connection.open-ok` a frame is at most the handshake's
//! size and only channel 0 is allowed; after it, at most the `frame_max` both sides agreed,
//! which the proxy keeps within its cap ([`Limits::max_frame`]). A buffer that grew for a long
//! frame is given back once empty, and everything is freed when the connection ends. Bytes pass
//! as they arrived except the frames [`rewrite`] changes.
//!
//! A delayed declare (or delete) is sent to the broker and the client is not read further
//! until the broker answered it: [`Replies`] tells which answer is that request's own, behind
//! those to the client's earlier requests on its channel.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch};

use super::Registry;
use super::frames::{self, HANDSHAKE_FRAME_MAX, Raw, Split};
use super::replies::{Ask, Replies};
use super::rewrite::{self, ClientSide, Offer, Request, Seen, Step};
use crate::logline::escape_controls;
use to_client::broker_to_client;

mod to_client;

/// How long a client waits for its delayed exchange's declare and registration, at most.
const DECLARE_TIMEOUT: Duration = Duration::from_secs(30);
/// AMQP's `internal-error` reply code.
const INTERNAL_ERROR: u16 = 541;
/// AMQP's `not-allowed` reply code.
const NOT_ALLOWED: u16 = 530;
/// AMQP's `connection-forced` reply code: what a broker that shuts down sends its clients.
const CONNECTION_FORCED: u16 = 320;
/// `connection.close-ok`.
const CLOSE_OK: frames::MethodId = (10, 51);
/// The most a pump asks to read at once.
const READ_CHUNK: usize = 64 * 1024;
/// A buffer larger than this (grown for a long frame) is given back once it is empty.
const KEPT_BUFFER: usize = 2 * READ_CHUNK;

/// The largest `frame_max` offered to clients by default (RabbitMQ's own default).
pub const DEFAULT_MAX_FRAME: u32 = 131_072;
/// Client connections open at once by default, in all.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1000;
/// Client connections open at once by default from one source address.
pub const DEFAULT_MAX_PER_ADDRESS: usize = 100;

/// The limits of a connection, and of the connections of a proxy.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// From accepting the client until the broker's `connection.open-ok`.
    pub handshake: Duration,
    /// No byte in either direction for this long ends the connection (heartbeats count).
    pub idle: Duration,
    /// On shutdown, how long clients get to answer the proxy's `connection.close`.
    pub drain: Duration,
    /// The largest `frame_max` a client is offered (the broker's when it is lower).
    pub max_frame: u32,
    /// Client connections open at once, in all: one more is refused.
    pub max_connections: usize,
    /// Client connections open at once from one source address: one more is refused.
    pub max_per_address: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(600),
            drain: Duration::from_secs(10),
            max_frame: DEFAULT_MAX_FRAME,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_address: DEFAULT_MAX_PER_ADDRESS,
        }
    }
}

/// What both pumps of a connection share.
struct Shared {
    /// The `frame_max` both sides keep to, from the client's `tune-ok` (0 until then).
    frame_max: AtomicU32,
    /// [`Limits::max_frame`].
    cap: u32,
    /// What the proxy offered the client in the broker's `connection.tune`.
    offered: Mutex<Option<Offer>>,
    opened: AtomicBool,
    /// The client opened the proxy's own virtual host: returns from ingresses are rewritten.
    acts: AtomicBool,
    /// The proxy asked the client to close (it shuts down): the client's close-ok ends the
    /// connection.
    closing: AtomicBool,
    /// When a byte last arrived from either side, ms since the connection started.
    last_io_ms: AtomicU64,
    /// The client's requests on each channel, and the delayed declare (or delete) sent to the
    /// broker, waiting for its answer.
    replies: Mutex<Replies<Pending>>,
}

/// A delayed declare or delete waiting for the broker's answer, and who asked.
struct Pending {
    exchange: String,
    nowait: bool,
    /// A delete (the pair ends at its delete-ok), else a declare (registered at declare-ok).
    delete: bool,
    /// The client's login user (`None`: its SASL mechanism does not name one).
    user: Option<String>,
    /// Its SASL mechanism (control characters escaped).
    mechanism: String,
    /// Its virtual host (the proxy's own: elsewhere nothing is rewritten).
    vhost: String,
    done: oneshot::Sender<()>,
}

impl Shared {
    fn new(cap: u32) -> Shared {
        Shared {
            frame_max: AtomicU32::new(0),
            cap,
            offered: Mutex::new(None),
            opened: AtomicBool::new(false),
            acts: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            last_io_ms: AtomicU64::new(0),
            replies: Mutex::new(Replies::default()),
        }
    }

    /// The longest frame either side may send now, with its 8 bytes of framing: the
    /// handshake's size until the connection is open, then the agreed `frame_max`.
    fn max_frame_bytes(&self) -> usize {
        let n = if !self.opened.load(Ordering::Acquire) {
            HANDSHAKE_FRAME_MAX
        } else {
            match self.frame_max.load(Ordering::Acquire) {
                0 => self.cap,
                n => n,
            }
        };
        n as usize + 8
    }

    fn replies(&self) -> MutexGuard<'_, Replies<Pending>> {
        self.replies.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn offered(&self) -> MutexGuard<'_, Option<Offer>> {
        self.offered.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whole frames from one side, one buffer each.
struct Frames<R> {
    r: R,
    buf: Vec<u8>,
    start: usize,
}

impl<R: AsyncRead + Unpin> Frames<R> {
    fn new(r: R) -> Self {
        Frames {
            r,
            buf: Vec::with_capacity(16 * 1024),
            start: 0,
        }
    }

    /// Reads more (after the frames at the front were handled); false at the end of input.
    async fn read_more(
        &mut self,
        shared: &Shared,
        epoch: tokio::time::Instant,
    ) -> Result<bool, String> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        if self.buf.is_empty() && self.buf.capacity() > KEPT_BUFFER {
            // a long frame is gone: so is its memory
            self.buf = Vec::with_capacity(16 * 1024);
        }
        let max = shared.max_frame_bytes();
        if self.buf.len() >= max {
            return Err(format!(
                "a frame is longer than the negotiated frame_max ({max} bytes with framing)"
            ));
        }
        let want = (max - self.buf.len()).min(READ_CHUNK);
        if self.buf.capacity() - self.buf.len() < want {
            self.buf.reserve_exact(want);
        }
        let n = self
            .r
            .read_buf(&mut self.buf)
            .await
            .map_err(|e| format!("reading: {e}"))?;
        let ms = u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        shared.last_io_ms.store(ms, Ordering::Release);
        Ok(n > 0)
    }
}

/// The broker nodes clients go to, and the TLS connector of the `amqps://` ones.
#[derive(Clone)]
pub struct Upstreams {
    /// In the order of the settings' URLs.
    pub nodes: Arc<Vec<super::Upstream>>,
    /// Present when a node is `amqps://`.
    pub tls: Option<crate::tls::TlsConnector>,
}

/// A connection to the broker.
enum Broker {
    Plain(TcpStream),
    Tls(Box<crate::tls::BrokerTls>),
}

/// The first node that accepts a connection (and, for `amqps://`, completes a verified TLS
/// handshake) within `limit` each.
async fn connect_upstream(up: &Upstreams, limit: Duration) -> Result<Broker, String> {
    let mut last = String::from("no broker address");
    for node in up.nodes.iter() {
        let attempt = async {
            let tcp = TcpStream::connect(&node.addr).await?;
            let _ = tcp.set_nodelay(true);
            match (&node.tls_host, &up.tls) {
                (None, _) => Ok(Broker::Plain(tcp)),
                (Some(host), Some(tls)) => Ok(Broker::Tls(Box::new(
                    crate::tls::connect(tls, tcp, host).await?,
                ))),
                (Some(_), None) => Err(std::io::Error::other("no TLS configuration")),
            }
        };
        match tokio::time::timeout(limit, attempt).await {
            Ok(Ok(b)) => return Ok(b),
            Ok(Err(e)) => last = format!("connecting to the broker at {}: {e}", node.addr),
            Err(_) => last = format!("connecting to the broker at {}: timed out", node.addr),
        }
    }
    Err(last)
}

/// Proxies one client connection until either side closes it or a limit ends it; once
/// `closing` turns true (the proxy shuts down), asks the client to close, as a broker that
/// shuts down does.
pub async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    client: S,
    upstreams: &Upstreams,
    registry: Arc<Registry>,
    limits: Limits,
    closing: watch::Receiver<bool>,
) -> Result<(), String> {
    match connect_upstream(upstreams, limits.handshake).await? {
        Broker::Plain(b) => pump(client, b, registry, limits, closing).await,
        Broker::Tls(b) => pump(client, *b, registry, limits, closing).await,
    }
}

/// The two pumps and the watchdog of a connection.
async fn pump<S, B>(
    client: S,
    broker: B,
    registry: Arc<Registry>,
    limits: Limits,
    closing: watch::Receiver<bool>,
) -> Result<(), String>
where
    S: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (cr, cw) = tokio::io::split(client);
    let (br, bw) = tokio::io::split(broker);
    let shared = Arc::new(Shared::new(limits.max_frame));
    let epoch = tokio::time::Instant::now();
    tokio::select! {
        r = client_to_broker(Frames::new(cr), bw, &shared, &registry, epoch) => r,
        r = broker_to_client(Frames::new(br), cw, &shared, &registry, epoch, closing) => r,
        r = watchdog(&shared, limits, epoch) => r,
    }
}

/// Writes `out` and empties it (giving back what a long frame made it take).
async fn write<W: AsyncWrite + Unpin>(w: &mut W, out: &mut Vec<u8>) -> Result<(), String> {
    if !out.is_empty() {
        w.write_all(out)
            .await
            .map_err(|e| format!("writing: {e}"))?;
        out.clear();
    }
    if out.capacity() > KEPT_BUFFER {
        *out = Vec::new();
    }
    Ok(())
}

/// What the client's pump must do before it handles the next frame.
enum Wait {
    /// Send the proxy's own request and wait until the broker answered it.
    Answer(Vec<u8>, oneshot::Receiver<()>),
    /// Know the pair of this exchange (a passive declare of it went out).
    Lookup(String),
    /// The client closed as the proxy asked.
    Bye,
}

/// The client's frames to the broker.
async fn client_to_broker<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut rd: Frames<R>,
    mut w: W,
    shared: &Shared,
    registry: &Registry,
    epoch: tokio::time::Instant,
) -> Result<(), String> {
    let mut side = ClientSide::new(registry.vhost());
    let mut out = Vec::new();
    loop {
        while let Some(wait) = client_frames(&mut rd, &mut side, &mut out, shared, registry)? {
            match wait {
                Wait::Answer(mut bytes, answered) => {
                    write(&mut w, &mut out).await?;
                    write(&mut w, &mut bytes).await?;
                    wait_for(answered).await?;
                }
                Wait::Lookup(x) => lookup(registry, &x).await,
                Wait::Bye => {
                    // the client closed as the proxy asked: close its broker connection
                    // (its channels, their unacked deliveries go back to their queues)
                    write(&mut w, &mut out).await?;
                    let text = "delay-proxy shut down; its client closed";
                    let mut bye = rewrite::close_connection(200, text)?;
                    write(&mut w, &mut bye).await?;
                    let _ = w.flush().await;
                    return Ok(());
                }
            }
        }
        write(&mut w, &mut out).await?;
        if !rd.read_more(shared, epoch).await? {
            return Ok(());
        }
    }
}

/// Handles the client's whole frames in `rd`'s buffer, adding what to send to `out`, until
/// one needs something done first (returned) or no whole frame is left (`None`).
fn client_frames<R>(
    rd: &mut Frames<R>,
    side: &mut ClientSide,
    out: &mut Vec<u8>,
    shared: &Shared,
    registry: &Registry,
) -> Result<Option<Wait>, String> {
    loop {
        let raw = match frames::split(&rd.buf[rd.start..]) {
            Split::Frame(raw) => raw,
            Split::ProtocolHeader(n) => {
                out.extend_from_slice(&rd.buf[rd.start..rd.start + n]);
                rd.start += n;
                continue;
            }
            Split::Incomplete => return Ok(None),
            Split::Invalid(e) => return Err(format!("from the client: {e}")),
        };
        let len = raw.len;
        let wait = client_frame(&raw, side, out, shared, registry)?;
        rd.start += len;
        if wait.is_some() {
            return Ok(wait);
        }
    }
}

/// One frame of the client: checked against the connection's state, rewritten or passed.
fn client_frame(
    raw: &Raw<'_>,
    side: &mut ClientSide,
    out: &mut Vec<u8>,
    shared: &Shared,
    registry: &Registry,
) -> Result<Option<Wait>, String> {
    check_channel(raw, side, shared)?;
    if shared.closing.load(Ordering::Acquire)
        && raw.kind == amq_protocol::frame::AMQPFrameType::Method
        && frames::method_id(raw.payload) == Some(CLOSE_OK)
    {
        return Ok(Some(Wait::Bye));
    }
    let seen = Seen {
        pairs: registry.pairs(),
        max_delay_ms: registry.max_delay_ms(),
        open: shared.replies().is_open(raw.channel),
        offered: *shared.offered(),
    };
    let step = side.frame(raw, &seen)?;
    if let Some(n) = side.frame_max {
        shared.frame_max.store(n, Ordering::Release);
    }
    shared.acts.store(side.acts(), Ordering::Release);
    let (d, delete) = match step {
        Step::Held => return Ok(None),
        Step::Declare(d) => (d, false),
        Step::Delete(d) => (d, true),
        Step::Bytes(b) => {
            out.extend_from_slice(&b);
            note(raw, shared)?;
            return Ok(None);
        }
        Step::Lookup(x) => {
            // a passive declare: pairs another proxy registered are known before it returns
            // (the frame is in `out`, sent at the next write)
            out.extend_from_slice(raw.bytes);
            note(raw, shared)?;
            return Ok(Some(Wait::Lookup(x)));
        }
        _ => {
            out.extend_from_slice(raw.bytes);
            note(raw, shared)?;
            return Ok(None);
        }
    };
    if let Err(e) = registry.pair_for(&d.exchange) {
        // sent as the client wrote it: a stock broker refuses the type
        tracing::warn!(exchange = %escape_controls(&d.exchange), "a delayed exchange cannot be proxied: {e}");
    } else {
        let (done, answered) = oneshot::channel();
        let pending = Pending {
            exchange: d.exchange,
            nowait: d.nowait,
            delete,
            user: side.user.clone(),
            mechanism: side.mechanism.clone(),
            vhost: side.vhost.clone().unwrap_or_default(),
            done,
        };
        let ask = if delete { Ask::Delete } else { Ask::Declare };
        if shared.replies().expect(d.channel, ask, pending).is_ok() {
            return Ok(Some(Wait::Answer(d.bytes, answered)));
        }
        // a channel that answers nothing any more: as it came, the broker ignores it
    }
    out.extend_from_slice(raw.bytes);
    note(raw, shared)?;
    Ok(None)
}

/// Ends the connection for a frame on a channel other than 0 before the connection is open
/// (nothing is held or buffered for a client that has not logged in), or above the
/// `channel_max` agreed.
fn check_channel(raw: &Raw<'_>, side: &ClientSide, shared: &Shared) -> Result<(), String> {
    if raw.channel == 0 {
        return Ok(());
    }
    if !shared.opened.load(Ordering::Acquire) {
        return Err(format!(
            "a frame on channel {} before the connection was open",
            raw.channel
        ));
    }
    match side.channel_max {
        Some(max) if raw.channel > max => Err(format!(
            "a frame on channel {}, above the channel_max {max} agreed",
            raw.channel
        )),
        _ => Ok(()),
    }
}

/// Counts what the client's frame `raw`, sent as it came, does to its channel's requests.
fn note(raw: &Raw<'_>, shared: &Shared) -> Result<(), String> {
    let Some(request) = rewrite::request(raw)? else {
        return Ok(());
    };
    let mut replies = shared.replies();
    match request {
        Request::Open => replies.client_opened(raw.channel),
        Request::Close => replies.client_closed(raw.channel),
        Request::Asks(ask) => replies.sent(raw.channel, ask),
    }
    Ok(())
}

/// Knows the pair of delayed exchange `x` before a passive declare of it returns: one another
/// proxy registered is read from the control stream.
async fn lookup(registry: &Registry, x: &str) {
    if registry.pairs().ingress_of(x).is_none()
        && let Err(e) = registry.refresh(false).await
    {
        tracing::warn!(
            "reading the control stream: {}",
            amqp_delay::error_chain(&e)
        );
    }
}

/// Waits until the other pump saw the broker's answer to the proxy's own request (and
/// registered the pair when it was declare-ok, ended it at delete-ok).
async fn wait_for(answered: oneshot::Receiver<()>) -> Result<(), String> {
    match tokio::time::timeout(DECLARE_TIMEOUT, answered).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err("the connection ended while a delayed exchange was declared".into()),
        Err(_) => Err(format!(
            "the broker did not answer a declare within {DECLARE_TIMEOUT:?}"
        )),
    }
}

/// Ends the connection when the handshake or an idle spell lasts too long. It wakes only when
/// one of the two could have run out (not every second: 1 000 idle connections woke it 1 000
/// times a second, about 2% of a core).
async fn watchdog(
    shared: &Shared,
    limits: Limits,
    epoch: tokio::time::Instant,
) -> Result<(), String> {
    loop {
        let now = epoch.elapsed();
        let opened = shared.opened.load(Ordering::Acquire);
        if !opened && now > limits.handshake {
            return Err(format!(
                "the AMQP handshake did not finish within {:?}",
                limits.handshake
            ));
        }
        let last = Duration::from_millis(shared.last_io_ms.load(Ordering::Acquire));
        let idle_end = last + limits.idle;
        if now > idle_end {
            return Err(format!("idle for {:?}", limits.idle));
        }
        let next = if opened {
            idle_end
        } else {
            idle_end.min(limits.handshake)
        };
        // a little past the deadline, so that the check above sees it passed
        let pause = next.saturating_sub(now) + Duration::from_millis(10);
        tokio::time::sleep(pause.max(Duration::from_millis(50))).await;
    }
}
