//! A gateway pair (ingress exchange → target exchange) with its queue names, the pairs the
//! control stream names, and ending or deleting a pair's objects.

use lapin::Connection;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};

use crate::broker;
use crate::control;
use crate::error::{Result, ResultExt};
use crate::layout::Layout;
use crate::settings::PairConfig;

/// One ingress → target pair with its queue names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    /// Exchange applications publish to with `x-delay`.
    pub ingress: String,
    /// Exchange the message is published to when due.
    pub target: String,
    /// Queue bound to the ingress exchange.
    pub ingress_queue: String,
    /// Destination queue of the pair's messages while they wait.
    pub due_queue: String,
    /// Where messages of this pair are parked (refused `x-delay`, unroutable at the target).
    pub parked_queue: String,
    /// Where the worker parks ingress messages it cannot read at all.
    pub ingress_parked_queue: String,
    /// The users whose ingress messages it delivers besides admins (empty: anyone the broker
    /// lets write the ingress), as configured ([`PairConfig::writers`]).
    pub writers: Vec<String>,
}

impl Pair {
    /// Computes the names and checks they are valid for `layout` (destination rules, lengths
    /// of the parking queues the worker declares).
    pub fn new(layout: &Layout, cfg: &PairConfig) -> Result<Pair, String> {
        let due_queue = layout.gateway_due_queue(&cfg.ingress);
        let pair = Pair {
            ingress: cfg.ingress.clone(),
            target: cfg.target.clone(),
            ingress_queue: layout.gateway_ingress_queue(&cfg.ingress),
            parked_queue: layout.parked_queue(&due_queue),
            ingress_parked_queue: layout.parked_queue(&layout.gateway_ingress_queue(&cfg.ingress)),
            due_queue,
            writers: cfg.writers.clone(),
        };
        for q in [&pair.ingress_queue, &pair.due_queue] {
            layout
                .validate_destination(q)
                .map_err(|e| format!("ingress '{}': {e}", cfg.ingress))?;
            let parked = layout.parked_queue(q);
            if parked.len() > 255 {
                return Err(format!(
                    "ingress '{}': its parking queue name '{parked:.60}…' would be {} bytes, more than 255; use a shorter ingress name or prefix",
                    cfg.ingress,
                    parked.len()
                ));
            }
        }
        Ok(pair)
    }
}

impl Pair {
    /// Every queue of the pair: ingress, due and the two parking queues.
    pub fn queues(&self) -> [&str; 4] {
        [
            &self.ingress_queue,
            &self.due_queue,
            &self.parked_queue,
            &self.ingress_parked_queue,
        ]
    }
}

/// The pairs declared under `layout`'s prefix by any gateway, from the control stream's
/// `records`, each once, in the order they were first declared; ended ones too (a teardown
/// deletes what is left of them, such as a parking queue that still held messages).
pub fn registered_pairs(layout: &Layout, records: &[control::Record]) -> Vec<Pair> {
    let mut out: Vec<Pair> = Vec::new();
    for r in records {
        if let control::Record::GatewayPair {
            ingress, target, ..
        }
        | control::Record::GatewayPairEnded {
            ingress, target, ..
        } = r
        {
            let (ingress, target) = (ingress.clone(), target.clone());
            if out.iter().any(|p| p.ingress == ingress) {
                continue;
            }
            let cfg = PairConfig {
                ingress,
                target,
                writers: Vec::new(),
            };
            match Pair::new(layout, &cfg) {
                Ok(p) => out.push(p),
                Err(e) => tracing::warn!("ignoring a gateway pair record: {e}"),
            }
        }
    }
    out
}

/// Ends `pair` (its target was deleted): deletes its ingress exchange first (nothing enters
/// any more), then its ingress and due queues (messages in them are lost), and its parking
/// queues only when they hold nothing (a teardown removes them later: the pair stays in the
/// control stream, ended). Missing objects are ignored.
pub async fn end_pair(conn: &Connection, pair: &Pair) -> Result<()> {
    let ch = broker::open(conn).await?;
    ch.exchange_delete(
        pair.ingress.as_str().into(),
        ExchangeDeleteOptions::default(),
    )
    .await
    .context(|| format!("deleting exchange '{}'", pair.ingress))?;
    for q in [&pair.ingress_queue, &pair.due_queue] {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .context(|| format!("deleting queue '{q}'"))?;
    }
    broker::close(&ch, "deleted").await;
    for q in [&pair.parked_queue, &pair.ingress_parked_queue] {
        match broker::queue_state(conn, q).await? {
            Some(s) if s.ready > 0 => {
                tracing::warn!(queue = %q, parked = s.ready, "a deleted delayed exchange's parking queue holds messages: left for you to read (teardown removes it)");
            }
            Some(_) => {
                let ch = broker::open(conn).await?;
                ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await
                    .context(|| format!("deleting queue '{q}'"))?;
                broker::close(&ch, "deleted").await;
            }
            None => {}
        }
    }
    Ok(())
}

/// Deletes the ingress exchanges and every queue of `pairs` (messages in them are lost);
/// missing objects are ignored. Leaves the targets and the tier topology.
pub(crate) async fn delete_pairs(conn: &Connection, pairs: &[Pair]) -> Result<()> {
    let ch = broker::open(conn).await?;
    for p in pairs {
        for q in p.queues() {
            ch.queue_delete(q.into(), QueueDeleteOptions::default())
                .await
                .context(|| format!("deleting queue '{q}'"))?;
        }
        ch.exchange_delete(p.ingress.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .context(|| format!("deleting exchange '{}'", p.ingress))?;
    }
    broker::close(&ch, "deleted").await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{PairConfig, Settings};

    #[test]
    fn pair_names_never_collide_and_are_checked() {
        let layout = Settings::default().layout().unwrap();
        let pair = |i: &str| {
            Pair::new(
                &layout,
                &PairConfig {
                    ingress: i.into(),
                    target: "t".into(),
                    writers: Vec::new(),
                },
            )
        };
        let a = pair("x").unwrap();
        let b = pair("x.due").unwrap();
        let c = pair("due.x").unwrap();
        let names = [
            &a.ingress_queue,
            &a.due_queue,
            &b.ingress_queue,
            &b.due_queue,
            &c.ingress_queue,
            &c.due_queue,
        ];
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        assert!(pair("a..b").is_err());
        assert!(pair("a.*").is_err());
        assert!(pair(&"x".repeat(220)).unwrap_err().contains("255"));
        assert!(pair(&"x".repeat(240)).is_err());
    }
}
