//! The follower's loops: the journal's, the control stream's, the end poll and the expiry;
//! and the one-off read of both streams into a temporary index.

use std::future::Future;
use std::time::Duration;

use lapin::Connection;

use super::*;

/// How long a control batch waits for the journal to reach the end it had when the batch was
/// read; past it the batch is applied anyway (a journal record that never comes, e.g. one the
/// reader had to skip, must not stop the cancels).
const CONTROL_WAIT: Duration = Duration::from_secs(10);
/// Entries a one-off read applies in one transaction, about (a journal record holds up to
/// 2 000).
const APPLY_ENTRIES: usize = 16_000;
/// How long a one-off read waits for the next record before it gives up.
const READ_STALL: Duration = Duration::from_secs(10);

/// Follows the journal and the control stream of `settings` into `index` until `shutdown`,
/// reconnecting (with backoff) after a loss; `status` tells how far behind it is.
pub async fn run(
    settings: Settings,
    index: SharedIndex,
    status: Status,
    options: FollowOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let layout = settings.layout()?;
    let connector = Connector::new(&settings)?;
    let trust = trust_of(&settings);
    let max_delay = layout.max_delay_ms();
    let mut tr = (
        Translator::new(trust.clone(), max_delay),
        Translator::new(trust, max_delay),
    );
    let (pos, replay, rebuilding) = with_index(&index, |ix| {
        Ok((ix.position()?, ix.mark(REPLAY_FROM)?, ix.rebuilding()))
    })
    .await?;
    if pos.is_none() && !rebuilding {
        with_index(&index, |ix| ix.begin_rebuild()).await?;
    }
    status.update(|i| {
        i.lag.journal_position = pos;
        i.lag.rebuilding = pos.is_none() || rebuilding;
    });
    // after a restart, read again from the oldest flush that was waiting for its confirm
    let mut replay = match (replay, pos) {
        (Some(r), Some(p)) => Some(r.min(p)),
        (r, p) => r.or(p),
    };
    let expiry = tokio::spawn(expire(index.clone(), options.clone()));
    tokio::pin!(shutdown);
    let mut backoff = Backoff::default();
    let result = loop {
        let once = async {
            let conn = connector.connect("amqp-delay pending follow").await?;
            let r = follow_once(&conn, &layout, &index, &status, &mut tr, replay, &options).await;
            amqp_delay::ops::broker::close_connection(&conn, "bye").await;
            r
        };
        let e = tokio::select! {
            r = once => match r {
                Ok(()) => continue,
                Err(e) => e,
            },
            () = &mut shutdown => break Ok(()),
        };
        if e.kind() == amqp_delay::ErrorKind::Usage {
            break Err(e);
        }
        replay = None;
        let why = amqp_delay::error_chain(&e);
        tracing::warn!("the pending follower stopped reading: {why}; reconnecting");
        status.update(|i| i.lag.error = Some(why));
        let pause = backoff.next_pause();
        tokio::select! {
            () = Backoff::wait(pause, connector.urls()) => {}
            () = &mut shutdown => break Ok(()),
        }
    };
    expiry.abort();
    result
}

/// One connection's reading: the three loops until one fails.
async fn follow_once(
    conn: &Connection,
    layout: &Layout,
    index: &SharedIndex,
    status: &Status,
    tr: &mut (Translator, Translator),
    replay: Option<u64>,
    options: &FollowOptions,
) -> Result<()> {
    let (pos, ctl) =
        with_index(index, |ix| Ok((ix.position()?, ix.mark(CONTROL_POSITION)?))).await?;
    let from = replay.or(pos).map_or(Start::First, Start::Offset);
    let jrx = pump(journal::tail(conn, layout, from).await?, JOURNAL_BATCH);
    let ctl = ctl.map_or(Start::First, Start::Offset);
    let crx = pump(control::tail(conn, layout, ctl).await?, READ_AHEAD);
    status.update(|i| i.lag.error = None);
    status.applied.send_replace(pos.unwrap_or(0));
    // `/readyz` of --metrics-addr: following the streams
    let _live = amqp_delay::metrics::Live::open();
    let (jt, ct) = tr;
    tokio::try_join!(
        journal_loop(jrx, pos.unwrap_or(0), index, status, jt),
        control_loop(crx, conn, layout, index, status, ct),
        poll_end(conn, layout, index, status, options.poll_end_every),
    )?;
    Ok(())
}

async fn journal_loop(
    mut rx: mpsc::Receiver<Result<journal::Entry<journal::Record>>>,
    mut committed: u64,
    index: &SharedIndex,
    status: &Status,
    tr: &mut Translator,
) -> Result<()> {
    loop {
        let b = batch(&mut rx, JOURNAL_BATCH).await?;
        let now = now_ms();
        let mut entries = Vec::new();
        for e in &b {
            if let Some(r) = &e.record {
                entries.extend(tr.journal(e.offset, e.by.as_deref(), r, now));
            }
        }
        let last = b.last().map_or(0, |e| e.offset + 1);
        committed = committed.max(last);
        let marks = vec![
            ("position", Some(committed)),
            (REPLAY_FROM, tr.flushes().replay_from()),
        ];
        apply(index, entries, marks).await?;
        status.applied_journal(committed);
    }
}

async fn control_loop(
    mut rx: mpsc::Receiver<Result<journal::Entry<control::Record>>>,
    conn: &Connection,
    layout: &Layout,
    index: &SharedIndex,
    status: &Status,
    tr: &mut Translator,
) -> Result<()> {
    let mut applied = status.applied.subscribe();
    loop {
        let b = batch(&mut rx, BATCH).await?;
        // every journal record this batch can name is before the journal's end as of now
        let target = journal::end_offset(conn, layout).await?.unwrap_or(0);
        let caught_up = applied.wait_for(|p| *p >= target);
        if tokio::time::timeout(CONTROL_WAIT, caught_up).await.is_err() {
            tracing::debug!(
                target,
                "applying control records before the journal caught up"
            );
        }
        let now = now_ms();
        let mut entries = Vec::new();
        for e in &b {
            if let Some(r) = &e.record {
                entries.extend(tr.control(e.by.as_deref(), r, now));
            }
        }
        let next = b.last().map_or(0, |e| e.offset + 1);
        apply(index, entries, vec![(CONTROL_POSITION, Some(next))]).await?;
        status.update(|i| i.lag.control_position = Some(next));
    }
}

/// Polls the journal's end for the lag, and ends a rebuild once the follower caught up.
async fn poll_end(
    conn: &Connection,
    layout: &Layout,
    index: &SharedIndex,
    status: &Status,
    every: Duration,
) -> Result<()> {
    loop {
        // taken before the end is asked: whatever was journaled before then lies before it
        let polled = now_ms();
        let end = journal::end_offset(conn, layout).await?.unwrap_or(0);
        status.update(|i| {
            i.lag.journal_end = Some(end);
            i.lag.end_polled_ms = Some(polled);
        });
        let lag = status.lag();
        if lag.rebuilding && lag.journal_position.unwrap_or(0) >= end {
            let started = std::time::Instant::now();
            with_index(index, |ix| ix.finish_rebuild()).await?;
            tracing::info!(elapsed = ?started.elapsed(), "the pending index is rebuilt from the journal");
            status.update(|i| i.lag.rebuilding = false);
        }
        tokio::time::sleep(every).await;
    }
}

/// Removes what finished before the history window, every `expire_every`.
async fn expire(index: SharedIndex, options: FollowOptions) {
    let window = options.history.as_millis() as u64;
    loop {
        tokio::time::sleep(options.expire_every).await;
        match with_index(&index, move |ix| ix.expire(window, now_ms())).await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(removed = n, "expired finished messages from the index"),
            Err(e) => tracing::warn!("expiring the index: {}", amqp_delay::error_chain(&e)),
        }
    }
}

/// Reads both streams from their start, once, into a new in-memory index: each up to a barrier
/// of our own, the journal first. What `pending` answers from when no index server is named
/// (at the scale of thousands). With the journal offset it read to.
pub async fn build_once(settings: &Settings, conn: &Connection) -> Result<(PendingIndex, u64)> {
    let layout = settings.layout()?;
    let trust = trust_of(settings);
    let mut ix = PendingIndex::open(std::path::Path::new(":memory:"), Default::default())
        .map_err(index_error)?;
    ix.begin_rebuild().map_err(index_error)?;
    let index: SharedIndex = Arc::new(Mutex::new(ix));
    let nonce = journal::barrier(conn, &layout).await?;
    let max_delay = layout.max_delay_ms();
    let mut tr = Translator::new(trust.clone(), max_delay);
    let tail = journal::tail(conn, &layout, Start::First).await?;
    let end = read_to_barrier(tail, &nonce, &index, |e| match &e.record {
        Some(journal::Record::Barrier { nonce: n }) if *n == nonce => None,
        Some(r) => Some(tr.journal(e.offset, e.by.as_deref(), r, now_ms())),
        None => Some(Vec::new()),
    })
    .await?;
    with_index(&index, |ix| ix.finish_rebuild()).await?;
    let nonce = uuid::Uuid::now_v7().to_string();
    let barrier = control::Record::Barrier {
        nonce: nonce.clone(),
    };
    control::append(conn, &layout, &barrier).await?;
    let mut ct = Translator::new(trust, max_delay);
    let now = now_ms();
    let tail = control::tail(conn, &layout, Start::First).await?;
    read_to_barrier(tail, &nonce, &index, |e| match &e.record {
        Some(control::Record::Barrier { nonce: n }) if *n == nonce => None,
        Some(r) => Some(ct.control(e.by.as_deref(), r, now)),
        None => Some(Vec::new()),
    })
    .await?;
    Arc::try_unwrap(index)
        .map_err(|_| Error::Stopped("the temporary index is still in use".into()))
        .map(|m| (m.into_inner().unwrap_or_else(|p| p.into_inner()), end))
}

/// Reads `tail` up to the barrier `nonce` (when `translate` says `None`), applying what it
/// makes of each record, about [`APPLY_ENTRIES`] entries a transaction; the offset after the
/// barrier.
async fn read_to_barrier<T: Follow>(
    mut tail: T,
    nonce: &str,
    index: &SharedIndex,
    mut translate: impl FnMut(&journal::Entry<T::R>) -> Option<Vec<Entry>>,
) -> Result<u64> {
    let mut entries = Vec::new();
    let r = loop {
        let e = match tokio::time::timeout(READ_STALL, tail.next()).await {
            Err(_) => {
                break Err(Error::Stopped(format!(
                    "no record arrived for {} s before the barrier {nonce}",
                    READ_STALL.as_secs()
                )));
            }
            Ok(None) => {
                break Err(Error::Stopped(
                    "the stream's reader ended (connection lost)".into(),
                ));
            }
            Ok(Some(Err(e))) => break Err(e),
            Ok(Some(Ok(e))) => e,
        };
        let Some(more) = translate(&e) else {
            break apply(index, std::mem::take(&mut entries), Vec::new())
                .await
                .map(|()| e.offset + 1);
        };
        entries.extend(more);
        if entries.len() >= APPLY_ENTRIES
            && let Err(e) = apply(index, std::mem::take(&mut entries), Vec::new()).await
        {
            break Err(e);
        }
    };
    tail.end().await;
    r
}
