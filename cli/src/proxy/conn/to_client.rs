//! The broker-to-client pump of one connection: frames as they came but those the proxy
//! rewrites or waits for (the answers to a delayed declare or delete), and the proxy's own
//! `connection.close` when it stops.

use super::*;

/// The broker's frames to the client; between two frames, the proxy's own close when
/// `closing` turns true.
pub(super) async fn broker_to_client<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
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
                    let acts = shared.acts.load(Ordering::Acquire);
                    let step = rewrite::server_frame(&raw, registry.pairs(), acts, shared.cap)?;
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
            server_step(step, bytes, &mut out, &mut w, shared, registry).await?;
        }
        write(&mut w, &mut out).await?;
        if !read_or_close(&mut rd, &mut w, shared, epoch, &mut closing, &mut told).await? {
            return Ok(());
        }
    }
}

/// Does what the broker's frame `bytes` asks of the connection (`step`), adding what the
/// client gets to `out`.
async fn server_step<W: AsyncWrite + Unpin>(
    step: Step,
    bytes: &[u8],
    out: &mut Vec<u8>,
    w: &mut W,
    shared: &Shared,
    registry: &Arc<Registry>,
) -> Result<(), String> {
    match step {
        Step::Bytes(b) => out.extend_from_slice(&b),
        Step::Tuned(offer, b) => {
            *shared.offered() = Some(offer);
            out.extend_from_slice(&b);
        }
        Step::DeclareOk(ch) => answered(ch, Ask::Declare, bytes, out, w, shared, registry).await?,
        Step::DeleteOk(ch) => answered(ch, Ask::Delete, bytes, out, w, shared, registry).await?,
        Step::Closed(ch) => {
            // refused (or the connection closed): the client reads on, no pair
            let gone = if ch == 0 {
                shared.replies().broker_ended()
            } else {
                shared.replies().broker_closed(ch)
            };
            if let Some(p) = gone {
                let _ = p.done.send(());
            }
            out.extend_from_slice(bytes);
        }
        Step::ChannelOpened(ch) => {
            shared.replies().broker_opened(ch);
            out.extend_from_slice(bytes);
        }
        Step::Opened => {
            shared.opened.store(true, Ordering::Release);
            out.extend_from_slice(bytes);
        }
        _ => out.extend_from_slice(bytes),
    }
    Ok(())
}

/// The broker's declare-ok (`ask` Declare) or delete-ok on `channel`, whose frame is `bytes`:
/// when it answers the pending delayed declare (or delete), registers the pair (or ends it)
/// before the client gets the answer (none for `nowait`); else it passes.
async fn answered<W: AsyncWrite + Unpin>(
    channel: u16,
    ask: Ask,
    bytes: &[u8],
    out: &mut Vec<u8>,
    w: &mut W,
    shared: &Shared,
    registry: &Arc<Registry>,
) -> Result<(), String> {
    let Some(p) = shared.replies().answered(channel, ask) else {
        out.extend_from_slice(bytes);
        return Ok(());
    };
    write(w, out).await?;
    if p.delete {
        // the exchange is gone (the client was allowed to delete it): what is left of its
        // pair only costs queues, so a failure here is logged, and the client gets its
        // delete-ok all the same
        if let Err(e) = registry.end(&p.exchange, p.user.as_deref(), &p.vhost).await {
            tracing::error!(exchange = %escape_controls(&p.exchange), "ending a deleted delayed exchange's pair: {}", amqp_delay::error_chain(&e));
        }
    } else if let Err((code, text)) = register(&p, registry).await {
        tracing::error!("{text}");
        out.extend_from_slice(&rewrite::close_connection(code, &text)?);
        write(w, out).await?;
        return Err(text);
    }
    if !p.nowait {
        out.extend_from_slice(bytes);
    }
    let _ = p.done.send(());
    Ok(())
}

/// Registers the pair of the delayed exchange the broker let `p`'s client declare, naming the
/// client's user as a writer; or the reply code and text the client's connection is closed
/// with.
async fn register(p: &Pending, registry: &Arc<Registry>) -> Result<(), (u16, String)> {
    let x = escape_controls(&p.exchange);
    let Some(user) = &p.user else {
        let text = format!(
            "delay-proxy cannot register delayed exchange '{x}': SASL mechanism {} does not name the user, whom the pair must name as its writer; log in with PLAIN or AMQPLAIN",
            p.mechanism
        );
        return Err((NOT_ALLOWED, text));
    };
    registry
        .ensure(&p.exchange, user, &p.vhost)
        .await
        .map_err(|e| {
            let why = amqp_delay::error_chain(&e);
            let text = format!("delay-proxy could not register delayed exchange '{x}': {why}");
            (INTERNAL_ERROR, text)
        })
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
