//! Operations on everything under a prefix, across the layers below: `teardown`.

use lapin::Connection;
use lapin::options::ExchangeDeleteOptions;

use crate::broker::{self, ResultExt};
use crate::control::{self, Record};
use crate::error::{Error, Result};
use crate::gateway;
use crate::layout::Layout;
use crate::management::Management;
use crate::settings::Settings;
use crate::topology::Topology;

/// The management API of `settings`, if it answers (one request, a few seconds at most).
pub async fn management(settings: &Settings) -> Option<Management> {
    let m = Management::new(&settings.url, settings.management_url.as_deref())?;
    match m.queues(&format!("{}.", settings.prefix)).await {
        Ok(_) => Some(m),
        Err(e) => {
            tracing::debug!("management API not used: {e}");
            None
        }
    }
}

/// What [`teardown`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Teardown {
    /// Ingress exchanges of the gateway pairs removed.
    pub pairs: Vec<String>,
    /// Batch markers removed.
    pub markers: usize,
}

/// Removes the topology under `layout`'s prefix, the gateway pairs and batch markers declared
/// under it (found in the control stream, so no configuration has to name them). Unless
/// `force`, refuses while the tiers, the unroutable queue or a gateway queue hold messages —
/// ready or held by the broker's dead-letter worker — since they would be lost; and, without
/// the management API (which alone sees held messages), refuses to call them empty.
pub async fn teardown(
    conn: &Connection,
    layout: &Layout,
    management: Option<&Management>,
    force: bool,
) -> Result<Teardown> {
    let records = control::read_all(conn, layout).await?;
    let pairs = gateway::registered_pairs(layout, &records);
    let topology = Topology::new(layout.clone());
    if !force {
        let stats = topology.stats_with(conn, management).await?;
        // tiers and the unroutable queue go with the topology; destinations' parking queues stay
        let unroutable = layout.unroutable_queue();
        let mut held: u64 = stats
            .iter()
            .filter(|s| s.kind != "parked" || s.queue == unroutable)
            .map(|s| s.messages)
            .sum();
        let infos = match management {
            Some(m) => Some(m.queues(&format!("{}.", layout.prefix())).await?),
            None => None,
        };
        for q in pairs.iter().flat_map(|p| p.queues()) {
            held += match infos.as_ref() {
                Some(i) => i.get(q).map_or(0, |q| q.messages),
                None => broker::queue_state(conn, q)
                    .await?
                    .map_or(0, |s| u64::from(s.ready)),
            };
        }
        if held > 0 {
            return Err(Error::Invalid(format!(
                "{held} messages are still in the tiers, the gateway queues or parked; they would be lost. Wait for them to drain, or pass --force"
            )));
        }
        if management.is_none() {
            return Err(Error::Invalid(
                "no message is ready in the tiers, but without the broker's management API messages held by its dead-letter worker (after a restart or failover) cannot be seen, so the topology cannot be called empty. Enable the management plugin (or set management_url), or pass --force if you are sure".into(),
            ));
        }
    }
    gateway::delete_pairs(conn, &pairs).await?;
    let mut markers: Vec<String> = records
        .iter()
        .filter_map(|r| match r {
            Record::BatchMarker { queue } => layout.batch_marker(queue),
            _ => None,
        })
        .collect();
    markers.sort();
    markers.dedup();
    let ch = broker::open(conn).await?;
    for m in &markers {
        ch.exchange_delete(m.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .context(|| format!("deleting exchange '{m}'"))?;
    }
    broker::close(&ch, "deleted").await;
    topology.delete(conn).await?;
    Ok(Teardown {
        pairs: pairs.into_iter().map(|p| p.ingress).collect(),
        markers: markers.len(),
    })
}
