//! `transfer --parked`: the old cluster's parking queues (`<prefix>.parked.<destination>` and
//! `<prefix>.parked`), moved into the new cluster's parking queue of the same destination so
//! that `parked list|show|retry|drop` there see and act on them; without `--parked`, counted.
//!
//! The parking queues looked at are those of the destinations a worker or an admin declared
//! (their batch-marker records), of the gateway pairs (due and ingress queues), of `--queue`
//! and of every destination a moved message had, and `<prefix>.parked` when no `--queue`
//! chooses: the same ones `stats` lists without the management API. Each copy is published
//! to the new park exchange (mandatory, confirmed), and the old message acked only then.

use futures::StreamExt;
use lapin::Channel;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;

use amqp_delay::ops::broker;
use amqp_delay::ops::transfer::{self, Parking, Reading};
use amqp_delay::{Error, Publisher, Result, Topology, error_chain as chain};

use super::Run;

/// Parked copies in flight at once.
const IN_FLIGHT: usize = 32;

impl Run {
    /// Adds the parking queues of `destinations` (those `--queue` chooses), of `--queue` and,
    /// when it chooses nothing, `<prefix>.parked`.
    pub(super) fn note_parking(&mut self, destinations: &[String]) {
        let chosen = |d: &String| self.queues.is_empty() || self.queues.contains(d);
        let mut names: Vec<String> = destinations
            .iter()
            .chain(&self.queues)
            .filter(|d| chosen(d))
            .map(|d| self.from.parked_queue(d))
            .collect();
        if self.queues.is_empty() {
            names.push(self.from.unroutable_queue());
        }
        // a longer name is no queue
        self.parking
            .extend(names.into_iter().filter(|n| n.len() <= 255));
    }

    /// Counts what the parking queues hold: what `--parked` would move (`would_move`), else
    /// what stays.
    pub(super) async fn count_parked(&mut self, would_move: bool) -> Result<()> {
        let mut n = 0u64;
        for q in &self.parking {
            if let Some(s) = broker::queue_state(&self.old, q).await? {
                n += u64::from(s.ready);
            }
        }
        match would_move {
            true => self.counts.parked = n,
            false => self.counts.parked_left = n,
        }
        Ok(())
    }

    /// Copies a chunk of parked deliveries of `queue` to the new cluster's parking queue and
    /// acks those whose copy was confirmed; how many it holds (left on the old cluster).
    pub(super) async fn parked_chunk(
        &mut self,
        ch: &Channel,
        queue: &str,
        chunk: Vec<Delivery>,
        publisher: &Publisher,
    ) -> Result<u64> {
        if let Err(why) = self.declare_parking(queue).await {
            self.counts.leave(why, chunk.len() as u64);
            return Ok(chunk.len() as u64);
        }
        let reading = Reading {
            from: &self.from,
            to: &self.to,
            trust: &self.trust,
            max_members: self.max_members,
        };
        let mut copies = Vec::with_capacity(chunk.len());
        for d in &chunk {
            self.counts.read += 1;
            let c = transfer::parked_copy(&reading, queue, d.routing_key.as_str(), &d.properties);
            match c {
                Ok(c) => {
                    self.counts.headers_removed += c.headers_removed as u64;
                    self.counts.maybe_duplicates += u64::from(d.redelivered);
                    copies.push(Some(c));
                }
                Err(reason) => {
                    self.counts.leave(format!("unreadable: {reason}"), 1);
                    copies.push(None);
                }
            }
        }
        let sent: Vec<Option<Result<()>>> = futures::stream::iter(chunk.iter().zip(copies))
            .map(|(d, c)| async move {
                let c = c?;
                let r = publisher
                    .publish_confirmed(&c.exchange, &c.routing_key, &d.data, c.properties)
                    .await;
                Some(r)
            })
            .buffered(IN_FLIGHT)
            .collect()
            .await;
        let mut held = 0;
        for (d, r) in chunk.iter().zip(sent) {
            match r {
                None => held += 1,
                Some(Err(e)) => {
                    self.counts
                        .leave(format!("parked copy not published: {}", chain(&e)), 1);
                    held += 1;
                }
                Some(Ok(())) => {
                    ch.basic_ack(d.delivery_tag, BasicAckOptions::default())
                        .await
                        .map_err(|e| {
                            Error::Stopped(format!(
                                "acking a moved parked message on '{queue}' (its copy is \
                                 confirmed; a re-run copies it again): {}",
                                chain(&e)
                            ))
                        })?;
                    self.counts.parked += 1;
                }
            }
        }
        Ok(held)
    }

    /// Makes sure the new cluster's parking queue for the old one's `queue` exists (once a
    /// run); why not, if it could not.
    async fn declare_parking(&mut self, queue: &str) -> std::result::Result<(), String> {
        let Some(Parking::Of(d)) = transfer::parking_of(&self.from, queue) else {
            // `<prefix>.parked` comes with the new cluster's topology
            return Ok(());
        };
        let dest = transfer::destination_on(&self.from, &self.to, d);
        if self.declared.contains(&dest) {
            return Ok(());
        }
        Topology::new(self.to.clone())
            .declare_parking(&self.new, &dest)
            .await
            .map_err(|e| {
                format!(
                    "the new cluster's parking queue '{}' could not be declared: {}",
                    self.to.parked_queue(&dest),
                    chain(&e)
                )
            })?;
        self.declared.insert(dest);
        Ok(())
    }
}
