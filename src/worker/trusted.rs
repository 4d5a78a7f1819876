//! What a worker believes of a delivery's writer: who owns it, and which of our headers it may
//! have set (a batch member's, an application's).

use crate::envelope;
use crate::headers;
use crate::metrics::Metrics;
use crate::trust::Trust;

/// Who owns a message with properties `props` (a plain one, or a batch member whose batch
/// had `batch`): its writer's `user_id`, or the owner a forwarder of ours named
/// ([`Trust::owner`]). A member's own `user_id` is not the broker's to check: its batch's is.
pub(super) fn owner_of(
    props: &lapin::BasicProperties,
    batch: Option<&lapin::BasicProperties>,
    trust: &Trust,
) -> Option<String> {
    let writer = batch
        .unwrap_or(props)
        .user_id()
        .as_ref()
        .map(|u| u.as_str());
    trust.owner(writer, envelope::owner_header(props).as_deref())
}

/// A batch member's properties as if it had been delivered alone: the `user_id` its batch's
/// writer had (the broker checked that one), never one the member claims, and only the
/// headers that writer is believed in ([`believed_headers`]).
pub(super) fn member_properties(
    member: lapin::BasicProperties,
    batch: &lapin::BasicProperties,
    trust: &Trust,
    queue: &str,
) -> lapin::BasicProperties {
    let writer = batch.user_id().as_ref().map(|u| u.as_str());
    // the member's own `user_id` is dropped (a copy without it: lapin cannot unset one)
    let member = match member.user_id() {
        Some(_) => {
            let omit = envelope::Omit {
                user_id: true,
                ..envelope::Omit::default()
            };
            envelope::copy_properties(&member, omit)
        }
        None => member,
    };
    let p = believed_headers(member, writer, trust, queue);
    match batch.user_id() {
        Some(u) => p.with_user_id(u.clone()),
        None => p,
    }
}

/// `props` with only the `x-delay-*` headers its writer is believed in: all of them from one
/// of ours (this process's user, a peer, an admin), only the schedule headers from anyone else
/// (a forged `x-delay-routing-key` would redirect a forward, a forged `x-delay-user-id` name
/// another user); the others are removed, counted and logged.
pub(super) fn believed_headers(
    props: lapin::BasicProperties,
    writer: Option<&str>,
    trust: &Trust,
    queue: &str,
) -> lapin::BasicProperties {
    let Some(h) = props.headers().as_ref() else {
        return props;
    };
    let forged = |k: &str| headers::is_ours(k) && !headers::is_schedule_header(k);
    if trust.vouches_for_headers(writer) || !h.inner().keys().any(|k| forged(k.as_str())) {
        return props;
    }
    let names: Vec<String> = h
        .inner()
        .keys()
        .filter(|k| forged(k.as_str()))
        .map(|k| k.to_string())
        .collect();
    let writer = writer.unwrap_or("(none)");
    tracing::warn!(queue, %writer, headers = %names.join(","), "removed x-delay-* headers its writer may not set");
    let metrics = crate::metrics::global();
    let label = Metrics::queue(queue);
    metrics
        .untrusted_headers_removed
        .get_or_create(&label)
        .inc();
    let clean = headers::filter(h, |k| !forged(k));
    props.with_headers(clean)
}

/// An application's message (a queue whose handler does not read our headers): it cannot set
/// our headers, nor pass for a batch. [`headers::ADDED_USER_ID`] is kept: it only keeps the
/// message's own `user_id` from being named at the target; so is [`headers::PUBLISHED_AT`],
/// which can only shorten the writer's own delay.
pub(super) fn strip_our_headers(raw: &mut lapin::message::Delivery) {
    let h = raw.properties.headers().clone().unwrap_or_default();
    let forged =
        |k: &str| headers::is_ours(k) && k != headers::ADDED_USER_ID && k != headers::PUBLISHED_AT;
    if h.inner().keys().any(|k| forged(k.as_str())) {
        let clean = headers::filter(&h, |k| !forged(k));
        raw.properties = raw.properties.clone().with_headers(clean);
    }
}
