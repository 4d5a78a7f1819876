//! The gateway's [`Handler`]: the ingress stage (read `x-delay`, schedule into the tiers, or
//! hold a short delay and publish it when due) and the due stage (rebuild the message and
//! publish it to its target).

use std::sync::Arc;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};

use super::Pair;
use super::writers::{self, Writers};
use super::x_delay::{parse_x_delay, restore, stash, text_header};
use crate::control;
use crate::envelope::Delivery;
use crate::error::Error;
use crate::headers::{INVALID, OWNER, PUBLISHED_AT, X_DELAY};
use crate::message::Message;
use crate::worker::{Context, Handler, Outcome};

/// What a pair's handlers share.
pub(super) struct PairCtx {
    pub(super) pair: Pair,
    pub(super) max_delay_ms: u64,
    /// Longest wait for the tier publish's confirm before the ingress message is requeued.
    pub(super) confirm_timeout: Duration,
    /// `gateway.hold`: delays up to this are held by the worker instead of crossing the tiers
    /// (0: none are).
    pub(super) hold_ms: u64,
    /// Who may deliver through each pair of the gateway.
    pub(super) writers: Arc<Writers>,
}

/// How publishing a held message straight to its target ended.
enum Held {
    Published,
    Cancelled,
    Failed,
}

/// Who owns an application's message: the `user_id` it published with (the broker checked
/// it), else the gateway's own user, which schedules it; their cancels (and an admin's) stop it.
fn ingress_owner(d: &Delivery, ctx: &Context) -> Option<String> {
    d.owner
        .clone()
        .or_else(|| ctx.trust().own().map(str::to_string))
}

/// The gateway's [`Handler`]: one value per subscribed queue.
#[derive(Clone)]
pub struct GatewayHandler {
    pub(super) ctx: Arc<PairCtx>,
    pub(super) ingress: bool,
}

impl Handler for GatewayHandler {
    async fn handle(&self, d: &Delivery, ctx: &Context) -> Outcome {
        if self.ingress {
            self.handle_ingress(d, ctx).await
        } else {
            self.handle_due(d, ctx).await
        }
    }

    /// The gateway only moves messages: its due stage publishes `consumer.io_concurrency` of
    /// them at once (the ingress takes no permit, see [`GatewayHandler::takes_permit`]).
    fn io_bound(&self) -> bool {
        true
    }

    /// The ingress takes applications' messages: their `x-delay-*` headers are not ours.
    fn reads_our_headers(&self) -> bool {
        !self.ingress
    }

    /// An ingress message waits for its batch to be confirmed (or, held, for one publish):
    /// bounded by the ingress prefetch, it takes no permit. One held through that wait would
    /// cap the ingress at `consumer.io_concurrency` messages per linger (a tenth of
    /// `publisher.grain`) and confirm, whatever the machine.
    fn takes_permit(&self, _d: &Delivery) -> bool {
        !self.ingress
    }

    /// An ingress message whose `x-delay` is at most `gateway.hold` is held by the worker, as
    /// it holds an early grain batch, and published straight to the target when due.
    fn due_at(&self, d: &Delivery) -> Option<u64> {
        let c = &self.ctx;
        if !self.ingress || c.hold_ms == 0 {
            return None;
        }
        let value = d.headers().and_then(|h| h.inner().get(X_DELAY));
        let now = crate::time::now_ms();
        let delay_ms = parse_x_delay(value, c.max_delay_ms).ok()?;
        let left = delay_ms.saturating_sub(waited_ms(d, now));
        (left <= c.hold_ms).then(|| now.saturating_add(left))
    }
}

impl GatewayHandler {
    /// Whether `d`'s writer (its broker-checked `user_id`) may deliver through the pair
    /// ([`writers`]); a writer not known yet is looked for in the control stream up to a
    /// barrier first. `Err` is what to do with the message instead: park it with the reason,
    /// or give it back when the control stream cannot be read.
    async fn writer_may_deliver(&self, d: &Delivery, ctx: &Context) -> Result<(), Outcome> {
        let (c, since) = (&self.ctx, crate::time::now_ms());
        let writer = d.properties.user_id().as_ref().map(|u| u.as_str());
        let (ingress, target) = (&c.pair.ingress, &c.pair.target);
        let check = || {
            let allowed = c.writers.allowed(ingress);
            writers::check(allowed.as_ref(), writer, ctx.trust(), ingress, target)
        };
        if check().is_ok() {
            return Ok(());
        }
        let append = async |r: control::Record| ctx.publisher().append_control(&r).await;
        if let Err(e) = c.writers.sync(since, append).await {
            return Err(Outcome::Requeue(format!(
                "reading the control stream for the writers of pair '{ingress}': {}",
                crate::error::chain(&e)
            )));
        }
        check().map_err(Outcome::Permanent)
    }

    async fn handle_ingress(&self, d: &Delivery, ctx: &Context) -> Outcome {
        let c = &self.ctx;
        if let Err(refused) = self.writer_may_deliver(d, ctx).await {
            return refused;
        }
        let value = d.headers().and_then(|h| h.inner().get(X_DELAY));
        let (delay_ms, invalid) = match parse_x_delay(value, c.max_delay_ms) {
            // counted from the publish when `delay-proxy` said when that was
            Ok(ms) => (ms.saturating_sub(waited_ms(d, crate::time::now_ms())), None),
            Err(reason) => (0, Some(reason)),
        };
        let owner = ingress_owner(d, ctx);
        let mut msg = due_message(
            &c.pair,
            Ingress {
                properties: &d.properties,
                routing_key: &d.routing_key,
                invalid: invalid.as_deref(),
                owner: owner.as_deref(),
            },
            d.body.clone(),
            delay_ms,
        );
        // held by the worker until now, its due time ([`GatewayHandler::due_at`])
        if let Some(due_at_ms) = d.due_at_ms.filter(|_| invalid.is_none()) {
            // what could not cross the tiers is parked whatever its delay, as it would be
            if let Err(e) = ctx.publisher().check(&msg) {
                return cannot_schedule(&e);
            }
            let held = self.publish_held(d, owner.as_deref(), (due_at_ms, delay_ms), &msg, ctx);
            match held.await {
                Held::Published => return Outcome::Success,
                Held::Cancelled => return Outcome::Cancelled,
                // due now: the due queue retries it, or parks it with the reason
                Held::Failed => msg.delay_ms = 0,
            }
        }
        let sent = tokio::time::timeout(c.confirm_timeout, ctx.publisher().schedule(msg)).await;
        match sent {
            Ok(Ok(_)) => Outcome::Success,
            // The message itself cannot travel (headers or body too large); a delay out of
            // range cannot happen (checked against the same layout): park it with the reason.
            Ok(Err(e @ (Error::Plan(_) | Error::Invalid(_)))) => cannot_schedule(&e),
            // Everything else (nack, lost channel, missing delivery exchange or due queue) is
            // the infrastructure's: the message waits in the ingress queue, unchanged.
            Ok(Err(e)) => Outcome::Requeue(format!(
                "moving the message into the tiers failed: {}",
                crate::error::chain(&e)
            )),
            Err(_) => Outcome::Requeue(format!(
                "the broker did not confirm the tier publish within {:?}",
                c.confirm_timeout
            )),
        }
    }

    /// Publishes a message the worker held until it was due to its target, as the due stage
    /// would, unless its owner (or the gateway's user, for a message published without a
    /// `user_id`) cancelled it. The ingress message is still unacked, so a gateway that dies
    /// loses nothing. [`Held::Failed`] when the publish was returned, refused or not confirmed
    /// in time, or the cancels could not be read: the caller sends the message through the due
    /// queue, whose checks, retries and parking then apply.
    async fn publish_held(
        &self,
        d: &Delivery,
        owner: Option<&str>,
        (due_at_ms, delay_ms): (u64, u64),
        msg: &Message,
        ctx: &Context,
    ) -> Held {
        let c = &self.ctx;
        let props = &msg.properties;
        match ctx.is_cancelled_as(&d.message_id, owner, due_at_ms).await {
            Ok(true) => return Held::Cancelled,
            Ok(false) => {}
            Err(_) => return Held::Failed,
        }
        // a purge covers it as the due queue's message it would have been; a reschedule is
        // carried out by the due queue's worker
        let subject = crate::cancel::Subject {
            id: &d.message_id,
            owner,
            queue: &c.pair.due_queue,
            due_at_ms: Some(due_at_ms),
            delay_ms: Some(delay_ms),
            attempt: 0,
            headers: d.headers(),
        };
        match ctx.steer(&subject) {
            crate::cancel::Steer::Run => {}
            crate::cancel::Steer::Cancelled | crate::cancel::Steer::Purged => {
                return Held::Cancelled;
            }
            _ => return Held::Failed,
        }
        let Ok((key, props)) = restore(props) else {
            return Held::Failed;
        };
        let target = &c.pair.target;
        let publish = ctx
            .publisher()
            .publish_confirmed(target, &key, &d.body, props);
        match tokio::time::timeout(c.confirm_timeout, publish).await {
            Ok(Ok(())) => Held::Published,
            Ok(Err(e)) => {
                tracing::debug!(%target, %key, error = %crate::error::chain(&e), "a held message goes through the due queue");
                Held::Failed
            }
            Err(_) => Held::Failed,
        }
    }

    async fn handle_due(&self, d: &Delivery, ctx: &Context) -> Outcome {
        let c = &self.ctx;
        // the due stage publishes to the target what it carries, with the routing key and
        // `x-delay-user-id` it names: only a gateway may have written it, not whoever may
        // write the tiers
        let writer = d.properties.user_id().as_ref().map(|u| u.as_str());
        if !ctx.trust().is_forwarder(writer) {
            return Outcome::Permanent(format!(
                "not written by a gateway: user_id '{}' is neither this gateway's user nor one of trust.peers",
                writer.unwrap_or("(none)")
            ));
        }
        let empty = FieldTable::default();
        match text_header(d.headers().unwrap_or(&empty), INVALID) {
            Ok(Some(reason)) => return Outcome::Permanent(reason),
            Ok(None) => {}
            Err(e) => return Outcome::Permanent(e),
        }
        let (key, props) = match restore(&d.properties) {
            Ok(r) => r,
            Err(reason) => return Outcome::Permanent(reason),
        };
        let target = &c.pair.target;
        match ctx
            .publisher()
            .publish_confirmed(target, &key, &d.body, props)
            .await
        {
            Ok(()) => Outcome::Success,
            Err(Error::Returned { .. }) => Outcome::Permanent(format!(
                "unroutable at exchange '{target}' with routing key '{key}': no binding matches"
            )),
            Err(e) => Outcome::Retry(format!(
                "publishing to '{target}': {}",
                crate::error::chain(&e)
            )),
        }
    }
}

/// How long `d` has waited since `delay-proxy` took its publish ([`PUBLISHED_AT`]) at `now_ms`:
/// 0 without the header, or for a time after now.
fn waited_ms(d: &Delivery, now_ms: u64) -> u64 {
    d.headers()
        .and_then(|h| h.inner().get(PUBLISHED_AT))
        .and_then(crate::headers::as_int)
        .and_then(|t| u64::try_from(t).ok())
        .map_or(0, |t| now_ms.saturating_sub(t))
}

/// An application's message as a gateway's ingress reads it.
pub struct Ingress<'a> {
    /// Its properties as published.
    pub properties: &'a lapin::BasicProperties,
    /// The routing key it was published with.
    pub routing_key: &'a str,
    /// Why it must be parked instead of delivered (a refused `x-delay`).
    pub invalid: Option<&'a str>,
    /// Who owns it: whose cancels (and admins') stop it.
    pub owner: Option<&'a str>,
}

/// What a gateway's ingress writes into `pair`'s due queue for `ingress` with `body`, due in
/// `delay_ms`: its properties stashed ([`stash`]: what the tiers must not carry moves into
/// `x-delay-*` headers, `CC` and `BCC` too) and its owner named in `x-delay-owner`, so that the
/// due stage delivers it to the target as published and its owner's cancels stop it. Written by
/// a gateway's user or one of `trust.peers` (the due stage believes no one else).
/// `import-plugin` writes the same for each message it moves out of the plugin.
pub fn due_message(pair: &Pair, ingress: Ingress<'_>, body: Vec<u8>, delay_ms: u64) -> Message {
    let mut props = stash(ingress.properties, ingress.routing_key, ingress.invalid);
    // the gateway's copy names its owner, so that the owner's cancels stop it
    if let Some(owner) = ingress.owner {
        let mut h = props.headers().clone().unwrap_or_default();
        h.insert(OWNER.into(), AMQPValue::LongString(owner.into()));
        props = props.with_headers(h);
    }
    let mut m = Message::new(pair.due_queue.clone(), delay_ms, body)
        .with_properties(props)
        .internal();
    m.target = Some(pair.target.clone());
    m
}

/// A message that cannot travel (headers or body too large) is parked with the reason.
fn cannot_schedule(e: &Error) -> Outcome {
    Outcome::Permanent(format!("cannot schedule: {}", crate::error::chain(e)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{PairConfig, Settings};

    /// A gateway handler of one pair, holding delays up to `hold_ms`.
    fn handler(ingress: bool, hold_ms: u64) -> GatewayHandler {
        let layout = Settings::default().layout().unwrap();
        let cfg = PairConfig {
            ingress: "i".into(),
            target: "t".into(),
            writers: Vec::new(),
        };
        let ctx = PairCtx {
            pair: Pair::new(&layout, &cfg).unwrap(),
            max_delay_ms: layout.max_delay_ms(),
            confirm_timeout: Duration::from_secs(1),
            hold_ms,
            writers: Arc::new(Writers::new([("i", &[][..])], false)),
        };
        GatewayHandler {
            ctx: Arc::new(ctx),
            ingress,
        }
    }

    /// An application's message with this `x-delay` header (none for `None`).
    fn with_x_delay(x_delay: Option<AMQPValue>) -> Delivery {
        let mut h = FieldTable::default();
        if let Some(v) = x_delay {
            h.insert(X_DELAY.into(), v);
        }
        let props = lapin::BasicProperties::default().with_headers(h);
        crate::envelope::decode("gw.in.i", b"x".to_vec(), props, "k", "i", false).0
    }

    #[test]
    fn the_delay_counts_from_the_proxys_publish_time_never_from_a_later_one() {
        let gw = handler(true, 100);
        let stamped = |delay: i64, at: AMQPValue| {
            let mut h = FieldTable::default();
            h.insert(X_DELAY.into(), AMQPValue::LongLongInt(delay));
            h.insert(PUBLISHED_AT.into(), at);
            let props = lapin::BasicProperties::default().with_headers(h);
            crate::envelope::decode("gw.in.i", b"x".to_vec(), props, "k", "i", false).0
        };
        let now = crate::time::now_ms();
        let at = |ms: u64| AMQPValue::LongLongInt(i64::try_from(ms).unwrap());
        // taken 1 s ago with x-delay 1.05 s: 50 ms are left, so it is held, due 1.05 s after
        // the publish and not before
        let d = stamped(1050, at(now - 1000));
        assert!((now - 1000 + 1050..=crate::time::now_ms() + 50).contains(&gw.due_at(&d).unwrap()));
        assert_eq!(waited_ms(&d, now), 1000);
        // a time after now counts as now; an unreadable one as no stamp
        assert_eq!(waited_ms(&stamped(5, at(now + 60_000)), now), 0);
        assert_eq!(
            waited_ms(&stamped(5, AMQPValue::LongString("x".into())), now),
            0
        );
        // long past: due at once (the writer's own message, as with a smaller x-delay)
        let due = gw.due_at(&stamped(1000, at(now - 3_600_000))).unwrap();
        assert!(due <= crate::time::now_ms());
    }

    #[test]
    fn only_a_valid_x_delay_up_to_the_hold_is_held_and_never_due_before_it_ends() {
        let gw = handler(true, 100);
        for ms in [0, 1, 50, 100] {
            let before = crate::time::now_ms();
            let due = gw.due_at(&with_x_delay(Some(AMQPValue::LongLongInt(ms))));
            let due = due.unwrap_or_else(|| panic!("x-delay {ms} is held"));
            assert!(
                due >= before + ms as u64,
                "x-delay {ms}: due {due}, asked at {before}"
            );
            assert!(due <= crate::time::now_ms() + ms as u64);
        }
        for v in [
            Some(AMQPValue::LongLongInt(101)),
            Some(AMQPValue::LongString("soon".into())),
        ] {
            assert_eq!(gw.due_at(&with_x_delay(v.clone())), None, "{v:?}");
        }
        // no x-delay is due now, as the plugin delivers it
        assert!(gw.due_at(&with_x_delay(None)).is_some());
        // holding off, or the due stage: nothing is held
        let x = Some(AMQPValue::LongLongInt(10));
        assert_eq!(handler(true, 0).due_at(&with_x_delay(x.clone())), None);
        assert_eq!(handler(false, 100).due_at(&with_x_delay(x)), None);
    }

    #[test]
    fn only_the_due_stage_takes_a_handler_permit() {
        let d = with_x_delay(Some(AMQPValue::LongLongInt(5_000)));
        assert!(!handler(true, 100).takes_permit(&d));
        assert!(!handler(true, 0).takes_permit(&d));
        assert!(handler(false, 100).takes_permit(&d));
    }
}
