//! What operators watch: an HTTP endpoint (axum) on `metrics_addr` serving `/metrics`
//! (Prometheus/OpenMetrics text of [`amqp_delay::metrics::global`]), `/healthz` (the process is alive)
//! and `/readyz` (connected to the broker and consuming; unready while reconnecting), plus a
//! sampler that reads every tier's depth periodically into `amqp_delay_tier_messages` and the
//! messages not yet due into `amqp_delay_messages_pending`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::admin;
use amqp_delay::Topology;
use amqp_delay::metrics::{self, DueLabel, TierLabel};
use amqp_delay::ops::connection::Connector;
use amqp_delay::ops::ledger;
use amqp_delay::settings::Settings;
use amqp_delay::{Error, Result};

async fn metrics_text() -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics::global().encode(),
    )
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// What `/readyz` checks, in its answer: one of the process's broker connections works (a
/// worker consumes, or a follower of a stream reads; [`amqp_delay::metrics::Live`]).
async fn readyz() -> (StatusCode, &'static str) {
    if metrics::global().connected.get() == 1 {
        (
            StatusCode::OK,
            "ready: a broker connection works (consuming, or following a stream)\n",
        )
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no broker connection works yet (connecting, or reconnecting)\n",
        )
    }
}

/// A metrics endpoint that cannot be served as configured (`metrics_addr`).
fn config(why: String) -> Error {
    amqp_delay::settings::SettingsError::Invalid(why).into()
}

/// Starts serving the endpoints on `addr` and, every `sample` (if not zero), sampling the tier
/// depths of `settings`' topology on a connection of its own. Returns the bound address (port 0
/// picks a free one); both run until the process ends.
pub async fn serve(addr: &str, settings: &Settings, sample: Duration) -> Result<SocketAddr> {
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| config(format!("metrics address '{addr}': {e} (use HOST:PORT)")))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| config(format!("cannot listen on {addr} for metrics: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| config(format!("metrics listener: {e}")))?;
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("the metrics endpoint stopped: {e}");
        }
    });
    if !sample.is_zero() {
        tokio::spawn(sample_tiers(settings.clone(), sample));
    }
    tracing::info!(%bound, "serving /metrics, /healthz and /readyz");
    Ok(bound)
}

/// Reads every tier's depth every `every` into `amqp_delay_tier_messages` (ready + held when the
/// management API answers, ready only otherwise), and the messages not yet due into
/// `amqp_delay_messages_pending` from a follower of the ledger stream (started again when it
/// stops). Errors are logged and the next round tries again.
async fn sample_tiers(settings: Settings, every: Duration) {
    let Ok(layout) = settings.layout() else {
        return;
    };
    let Ok(connector) = Connector::new(&settings) else {
        return;
    };
    let topology = Topology::new(layout.clone());
    let mut conn: Option<Arc<lapin::Connection>> = None;
    let mut following: Option<ledger::Following> = None;
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        if conn.as_ref().is_none_or(|c| !c.status().connected()) {
            following = None;
            conn = connector
                .connect("amqp-delay metrics")
                .await
                .ok()
                .map(Arc::new);
        }
        let Some(c) = conn.as_ref() else { continue };
        let management = admin::management(&settings).await;
        match topology.stats_with(c, management.as_ref()).await {
            Ok(stats) => {
                let g = &metrics::global().tier_messages;
                for s in stats {
                    let label = TierLabel {
                        queue: s.queue,
                        kind: s.kind.to_string(),
                    };
                    g.get_or_create(&label)
                        .set(i64::try_from(s.messages).unwrap_or(i64::MAX));
                    if let Some(n) = s.dead_lettered {
                        metrics::global()
                            .tier_dead_lettered
                            .get_or_create(&label)
                            .set(i64::try_from(n).unwrap_or(i64::MAX));
                    }
                }
            }
            Err(e) => tracing::debug!("sampling tier depths: {e}"),
        }
        if following.as_ref().is_none_or(|f| !f.is_following()) {
            following = match ledger::follow(c.clone(), &layout, &settings.trust).await {
                Ok(f) => f,
                Err(e) => {
                    tracing::debug!("following the ledger: {e}");
                    None
                }
            };
        }
        if let Some(f) = following.as_ref() {
            let p = f.pending(amqp_delay::time::now_ms());
            let g = &metrics::global().messages_pending;
            for (bound, n) in [
                ("1m", p.within_1m),
                ("1h", p.within_1h),
                ("1d", p.within_1d),
                ("all", p.total),
            ] {
                g.get_or_create(&DueLabel {
                    due_within: bound.into(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }
}
