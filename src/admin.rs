//! Operations on everything under a prefix, across the layers below: `teardown`.

use lapin::Connection;
use lapin::options::ExchangeDeleteOptions;

use crate::broker::{self, ResultExt};
use crate::control::{self, Record};
use crate::error::{Error, Result};
use crate::gateway;
use crate::layout::Layout;
use crate::topology::Topology;

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
/// `force`, refuses while the tiers, the unroutable queue or a gateway queue hold messages:
/// they would be lost.
pub async fn teardown(conn: &Connection, layout: &Layout, force: bool) -> Result<Teardown> {
    let records = control::read_all(conn, layout).await?;
    let pairs = gateway::registered_pairs(layout, &records);
    let topology = Topology::new(layout.clone());
    if !force {
        let mut held: u64 = topology
            .stats(conn)
            .await?
            .iter()
            .map(|s| u64::from(s.messages))
            .sum();
        for q in pairs.iter().flat_map(|p| p.queues()) {
            if let Some(s) = broker::queue_state(conn, q).await? {
                held += u64::from(s.ready);
            }
        }
        if held > 0 {
            return Err(Error::Invalid(format!(
                "{held} messages are still in the tiers, the gateway queues or parked; they would be lost. Wait for them to drain, or pass --force"
            )));
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
