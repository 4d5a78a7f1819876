//! One client connection: an upstream TCP connection of its own to the broker, and a pump per
//! direction. Each pump reads whole frames into a buffer of at most one frame (the negotiated
//! `frame_max`) and writes what it read before it reads again, so a slow reader on one side
//! stops the other side's reads (TCP backpressure) and no connection grows the proxy's memory.
//! Bytes pass as they arrived except the frames [`rewrite`] changes.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch};

use super::Registry;
use super::frames::{self, HANDSHAKE_FRAME_MAX, Split};
use super::rewrite::{self, ClientSide, DelayedDeclare, Step};

/// The largest frame accepted when the client's `tune-ok` leaves `frame_max` unlimited (0).
const UNLIMITED_FRAME_MAX: u32 = 1 << 20;
/// How long a client waits for its delayed exchange's declare and registration, at most.
const DECLARE_TIMEOUT: Duration = Duration::from_secs(30);
/// AMQP's `internal-error` reply code.
const INTERNAL_ERROR: u16 = 541;
/// AMQP's `connection-forced` reply code: what a broker that shuts down sends its clients.
const CONNECTION_FORCED: u16 = 320;
/// `connection.close-ok`.
const CLOSE_OK: frames::MethodId = (10, 51);

/// The time limits of a connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// From accepting the client until the broker's `connection.open-ok`.
    pub handshake: Duration,
    /// No byte in either direction for this long ends the connection (heartbeats count).
    pub idle: Duration,
    /// On shutdown, how long clients get to answer the proxy's `connection.close`.
    pub drain: Duration,
}

/// What both pumps of a connection share.
#[derive(Default)]
struct Shared {
    /// The client's `frame_max` (0 until its `tune-ok`).
    frame_max: AtomicU32,
    opened: AtomicBool,
    /// The proxy asked the client to close (it shuts down): the client's close-ok ends the
    /// connection.
    closing: AtomicBool,
    /// When a byte last arrived from either side, ms since the connection started.
    last_io_ms: AtomicU64,
    /// The delayed declare (or delete) sent to the broker, waiting for its answer.
    declare: Mutex<Option<Pending>>,
}

struct Pending {
    channel: u16,
    exchange: String,
    nowait: bool,
    /// A delete (the pair ends at its delete-ok), else a declare (registered at declare-ok).
    delete: bool,
    done: oneshot::Sender<()>,
}

impl Shared {
    /// The longest frame either side may send now, with its 8 bytes of framing.
    fn max_frame_bytes(&self) -> usize {
        let n = match self.frame_max.load(Ordering::Acquire) {
            0 if !self.opened.load(Ordering::Acquire) => HANDSHAKE_FRAME_MAX,
            0 => UNLIMITED_FRAME_MAX,
            n => n.max(HANDSHAKE_FRAME_MAX),
        };
        n as usize + 8
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Option<Pending>> {
        self.declare.lock().unwrap_or_else(|e| e.into_inner())
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
        let max = shared.max_frame_bytes();
        if self.buf.len() >= max {
            return Err(format!(
                "a frame is longer than the negotiated frame_max ({max} bytes with framing)"
            ));
        }
        self.buf.reserve((max - self.buf.len()).min(64 * 1024));
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
    pub tls: Option<futures_rustls::TlsConnector>,
}

/// A connection to the broker.
enum Broker {
    Plain(TcpStream),
    Tls(Box<super::tls::BrokerTls>),
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
                    super::tls::connect(tls, tcp, host).await?,
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
    let shared = Arc::new(Shared::default());
    let epoch = tokio::time::Instant::now();
    tokio::select! {
        r = client_to_broker(Frames::new(cr), bw, &shared, &registry, epoch) => r,
        r = broker_to_client(Frames::new(br), cw, &shared, &registry, epoch, closing) => r,
        r = watchdog(&shared, limits, epoch) => r,
    }
}

async fn write<W: AsyncWrite + Unpin>(w: &mut W, out: &mut Vec<u8>) -> Result<(), String> {
    if !out.is_empty() {
        w.write_all(out)
            .await
            .map_err(|e| format!("writing: {e}"))?;
        out.clear();
    }
    Ok(())
}

/// The client's frames to the broker.
async fn client_to_broker<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut rd: Frames<R>,
    mut w: W,
    shared: &Shared,
    registry: &Registry,
    epoch: tokio::time::Instant,
) -> Result<(), String> {
    let mut side = ClientSide::default();
    let mut out = Vec::new();
    loop {
        loop {
            let step = match frames::split(&rd.buf[rd.start..]) {
                Split::Frame(raw) => {
                    if shared.closing.load(Ordering::Acquire)
                        && raw.kind == amq_protocol::frame::AMQPFrameType::Method
                        && frames::method_id(raw.payload) == Some(CLOSE_OK)
                    {
                        // the client closed as the proxy asked: close its broker connection
                        // (its channels, their unacked deliveries go back to their queues)
                        write(&mut w, &mut out).await?;
                        let text = "delay-proxy shut down; its client closed";
                        let mut bye = rewrite::close_connection(200, text)?;
                        write(&mut w, &mut bye).await?;
                        let _ = w.flush().await;
                        return Ok(());
                    }
                    let mut step = side.frame(&raw, registry.pairs(), registry.max_delay_ms())?;
                    if let Some(n) = side.frame_max.take() {
                        shared.frame_max.store(n, Ordering::Release);
                    }
                    if let Step::Declare(d) = &step
                        && let Err(e) = registry.pair_for(&d.exchange)
                    {
                        // sent as the client wrote it: a stock broker refuses the type
                        tracing::warn!(exchange = %d.exchange, "a delayed exchange cannot be proxied: {e}");
                        step = Step::Pass;
                    }
                    // a passive declare too: it leaves at the next write, after the lookup
                    if matches!(step, Step::Pass | Step::Lookup(_)) {
                        out.extend_from_slice(raw.bytes);
                    }
                    rd.start += raw.len;
                    step
                }
                Split::ProtocolHeader(n) => {
                    out.extend_from_slice(&rd.buf[rd.start..rd.start + n]);
                    rd.start += n;
                    continue;
                }
                Split::Incomplete => break,
                Split::Invalid(e) => return Err(format!("from the client: {e}")),
            };
            match step {
                Step::Bytes(b) => out.extend_from_slice(&b),
                Step::Declare(d) => {
                    write(&mut w, &mut out).await?;
                    declare(&mut w, d, false, shared).await?;
                }
                Step::Delete(d) => {
                    write(&mut w, &mut out).await?;
                    declare(&mut w, d, true, shared).await?;
                }
                Step::Lookup(x) => {
                    // a passive declare: pairs another proxy registered are known before it
                    // returns (the frame is already in `out`, sent at the next write)
                    if registry.pairs().ingress_of(&x).is_none()
                        && let Err(e) = registry.refresh(false).await
                    {
                        tracing::warn!(
                            "reading the control stream: {}",
                            amqp_delay::error::chain(&e)
                        );
                    }
                }
                _ => {}
            }
        }
        write(&mut w, &mut out).await?;
        if !rd.read_more(shared, epoch).await? {
            return Ok(());
        }
    }
}

/// Sends the rewritten declare (or delete) and waits until the other pump saw the broker's
/// answer (and registered the pair when it was declare-ok, ended it at delete-ok).
async fn declare<W: AsyncWrite + Unpin>(
    w: &mut W,
    d: DelayedDeclare,
    delete: bool,
    shared: &Shared,
) -> Result<(), String> {
    let mut bytes = d.bytes;
    let (done, answered) = oneshot::channel();
    *shared.pending() = Some(Pending {
        channel: d.channel,
        exchange: d.exchange,
        nowait: d.nowait,
        delete,
        done,
    });
    write(w, &mut bytes).await?;
    match tokio::time::timeout(DECLARE_TIMEOUT, answered).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err("the connection ended while a delayed exchange was declared".into()),
        Err(_) => Err(format!(
            "the broker did not answer a declare within {DECLARE_TIMEOUT:?}"
        )),
    }
}

/// The broker's frames to the client; between two frames, the proxy's own close when
/// `closing` turns true.
async fn broker_to_client<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut rd: Frames<R>,
    mut w: W,
    shared: &Shared,
    registry: &Arc<Registry>,
    epoch: tokio::time::Instant,
    mut closing: watch::Receiver<bool>,
) -> Result<(), String> {
    let mut out = Vec::new();
    let mut told = false;
    loop {
        loop {
            let (step, frame) = match frames::split(&rd.buf[rd.start..]) {
                Split::Frame(raw) => {
                    let step = rewrite::server_frame(&raw, registry.pairs())?;
                    rd.start += raw.len;
                    (step, rd.start - raw.len..rd.start)
                }
                Split::ProtocolHeader(n) => {
                    rd.start += n;
                    (Step::Pass, rd.start - n..rd.start)
                }
                Split::Incomplete => break,
                Split::Invalid(e) => return Err(format!("from the broker: {e}")),
            };
            let bytes = &rd.buf[frame];
            match step {
                Step::Bytes(b) => out.extend_from_slice(&b),
                Step::DeclareOk(ch) => {
                    answered(ch, false, bytes, &mut out, &mut w, shared, registry).await?;
                }
                Step::DeleteOk(ch) => {
                    answered(ch, true, bytes, &mut out, &mut w, shared, registry).await?;
                }
                Step::Closed(ch) => {
                    // refused (or the connection closed): the client reads on, no pair
                    if let Some(p) = take_pending(shared, (ch != 0).then_some(ch), None) {
                        let _ = p.done.send(());
                    }
                    out.extend_from_slice(bytes);
                }
                Step::Opened => {
                    shared.opened.store(true, Ordering::Release);
                    out.extend_from_slice(bytes);
                }
                _ => out.extend_from_slice(bytes),
            }
        }
        write(&mut w, &mut out).await?;
        if !read_or_close(&mut rd, &mut w, shared, epoch, &mut closing, &mut told).await? {
            return Ok(());
        }
    }
}

/// The broker's declare-ok (`delete` false) or delete-ok on `channel`, whose frame is
/// `bytes`: when it answers the pending delayed declare (or delete), registers the pair (or
/// ends it) before the client gets the answer (none for `nowait`); else it passes.
async fn answered<W: AsyncWrite + Unpin>(
    channel: u16,
    delete: bool,
    bytes: &[u8],
    out: &mut Vec<u8>,
    w: &mut W,
    shared: &Shared,
    registry: &Arc<Registry>,
) -> Result<(), String> {
    let Some(p) = take_pending(shared, Some(channel), Some(delete)) else {
        out.extend_from_slice(bytes);
        return Ok(());
    };
    write(w, out).await?;
    if delete {
        // the exchange is gone (the client was allowed to delete it): what is left of its
        // pair only costs queues, so a failure here is logged, and the client gets its
        // delete-ok all the same
        if let Err(e) = registry.end(&p.exchange).await {
            tracing::error!(exchange = %p.exchange, "ending a deleted delayed exchange's pair: {}", amqp_delay::error::chain(&e));
        }
    } else if let Err(e) = registry.ensure(&p.exchange).await {
        let text = format!(
            "delay-proxy could not register delayed exchange '{}': {}",
            p.exchange,
            amqp_delay::error::chain(&e)
        );
        tracing::error!("{text}");
        out.extend_from_slice(&rewrite::close_connection(INTERNAL_ERROR, &text)?);
        write(w, out).await?;
        return Err(text);
    }
    if !p.nowait {
        out.extend_from_slice(bytes);
    }
    let _ = p.done.send(());
    Ok(())
}

/// Reads more from the broker (false at its end); the first time `closing` turns true while
/// it waits, sends the client the proxy's `connection.close` 320 (between two frames: what
/// was read is all forwarded), as a broker that shuts down does.
async fn read_or_close<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    rd: &mut Frames<R>,
    w: &mut W,
    shared: &Shared,
    epoch: tokio::time::Instant,
    closing: &mut watch::Receiver<bool>,
    told: &mut bool,
) -> Result<bool, String> {
    loop {
        tokio::select! {
            // cancel-safe: what it read stays in the buffer
            r = rd.read_more(shared, epoch) => return r,
            _ = async { closing.wait_for(|c| *c).await.is_ok() }, if !*told => {
                *told = true;
                if !shared.opened.load(Ordering::Acquire) {
                    return Err("delay-proxy is shutting down".into());
                }
                shared.closing.store(true, Ordering::Release);
                let text = "CONNECTION_FORCED - delay-proxy is shutting down";
                let mut bye = rewrite::close_connection(CONNECTION_FORCED, text)?;
                write(w, &mut bye).await?;
            }
        }
    }
}

/// The pending declare or delete, when it was sent on `channel` (any channel for `None`) and
/// is a delete as `delete` says (either for `None`).
fn take_pending(shared: &Shared, channel: Option<u16>, delete: Option<bool>) -> Option<Pending> {
    let mut p = shared.pending();
    if p.as_ref().is_some_and(|p| {
        channel.is_none_or(|c| c == p.channel) && delete.is_none_or(|d| d == p.delete)
    }) {
        p.take()
    } else {
        None
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
