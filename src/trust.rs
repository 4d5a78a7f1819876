//! Who wrote a record or a message, and what that lets it do, pure. The broker checks the
//! AMQP `user_id` property of every publish against the publishing connection's user (unless
//! that user has the `impersonator` tag; DESIGN rule 15), so a `user_id` on a stream record
//! or a message is the name of the user who wrote it; every record and message of ours
//! carries one. What a follower, a worker or a gateway believes of what it reads follows from
//! that name:
//!
//! * a **cancel** (tombstone) stops a message only when its writer is the message's owner or
//!   an admin (`trust.admins`);
//! * a message's **owner** is its `user_id`, unless that user is one of ours that moves
//!   messages on behalf of others (this process's own user and `trust.peers`: a worker's
//!   retry, a gateway's hop) or an admin (`transfer` from another cluster), whose copy names
//!   the owner in `x-delay-owner` (an admin may cancel any message, so naming an owner gives
//!   it nothing more); a message without `user_id` has no owner, and only an admin can cancel
//!   it;
//! * **checkpoints** of the control stream and **snapshots** of the ledger, which stand for
//!   everything before them, count only from this process's own user, the admins and the
//!   peers; so do gateway pairs and batch markers, which `teardown` acts on;
//! * the gateway's **due stage** publishes to the target only what a gateway (own user or a
//!   peer) wrote.
//!
//! Anything else from anyone (a record without `user_id`, a checkpoint of a stranger) is
//! skipped and counted, never believed.

use std::collections::BTreeSet;

use crate::settings::TrustSettings;

/// What this process believes of the users who wrote what it reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trust {
    /// The user this process connects as (`None` when the URL names none).
    own: Option<String>,
    admins: BTreeSet<String>,
    peers: BTreeSet<String>,
    /// `trust.max_schedules_per_user` (`None`: the default).
    schedules_per_user: Option<usize>,
}

impl Trust {
    /// The trust of a process connected as `own`, with the configured admins and peers.
    pub fn new(own: Option<String>, settings: &TrustSettings) -> Trust {
        Trust {
            own: own.filter(|u| !u.is_empty()),
            admins: settings.admins.iter().cloned().collect(),
            peers: settings.peers.iter().cloned().collect(),
            schedules_per_user: Some(settings.max_schedules_per_user),
        }
    }

    /// Recurring schedules a user who is no admin may have, at most
    /// (`trust.max_schedules_per_user`).
    pub fn max_schedules_per_user(&self) -> usize {
        self.schedules_per_user
            .unwrap_or(crate::settings::DEFAULT_MAX_SCHEDULES_PER_USER)
    }

    /// The user this process writes as: the `user_id` it puts on what it publishes.
    pub fn own(&self) -> Option<&str> {
        self.own.as_deref()
    }

    /// The configured admins.
    pub fn admins(&self) -> impl Iterator<Item = &str> {
        self.admins.iter().map(String::as_str)
    }

    /// Whether `user` is an admin: may cancel any message.
    pub fn is_admin(&self, user: &str) -> bool {
        self.admins.contains(user)
    }

    /// Whether `by` moves messages on others' behalf (this process's user or a peer): its
    /// copies name their owner in `x-delay-owner`, and the gateway's due stage takes them.
    pub fn is_forwarder(&self, by: Option<&str>) -> bool {
        by.is_some_and(|u| self.own.as_deref() == Some(u) || self.peers.contains(u))
    }

    /// Whether a record by `by` may stand for others' records (a checkpoint, a snapshot) or
    /// name what `teardown` deletes (a gateway pair, a batch marker): this process's user, an
    /// admin or a peer.
    pub fn may_compact(&self, by: Option<&str>) -> bool {
        self.is_forwarder(by) || by.is_some_and(|u| self.is_admin(u))
    }

    /// Whether a message written by `by` is believed in every `x-delay-*` header it carries
    /// (a routing key, a user, an owner, a parking reason): this process's user, an admin or
    /// a peer. Anyone else's carry only the schedule headers, which steer nothing but their
    /// own message ([`crate::headers::is_schedule_header`]).
    pub fn vouches_for_headers(&self, by: Option<&str>) -> bool {
        self.may_compact(by)
    }

    /// The owner of a message published by `user_id` (broker-checked) naming `owner_header`
    /// (`x-delay-owner`): the header only when a forwarder or an admin wrote the message.
    pub fn owner(&self, user_id: Option<&str>, owner_header: Option<&str>) -> Option<String> {
        let user_id = user_id.filter(|u| !u.is_empty())?;
        if self.vouches_for_headers(Some(user_id)) {
            return Some(
                owner_header
                    .filter(|o| !o.is_empty())
                    .unwrap_or(user_id)
                    .to_string(),
            );
        }
        Some(user_id.to_string())
    }

    /// Whether a tombstone written by `writer` stops a message owned by `owner`.
    pub fn may_cancel(&self, writer: &str, owner: Option<&str>) -> bool {
        owner == Some(writer) || self.is_admin(writer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trust(own: &str) -> Trust {
        Trust::new(
            Some(own.into()),
            &TrustSettings {
                admins: vec!["admin".into()],
                peers: vec!["gw2".into()],
                ..Default::default()
            },
        )
    }

    #[test]
    fn a_message_is_owned_by_its_writer_unless_a_forwarder_or_admin_names_its_owner() {
        let t = trust("worker");
        assert_eq!(t.owner(Some("alice"), None).as_deref(), Some("alice"));
        // a stranger's header is no proof of anything
        assert_eq!(
            t.owner(Some("mallory"), Some("alice")).as_deref(),
            Some("mallory")
        );
        assert_eq!(
            t.owner(Some("worker"), Some("alice")).as_deref(),
            Some("alice")
        );
        assert_eq!(
            t.owner(Some("gw2"), Some("alice")).as_deref(),
            Some("alice")
        );
        assert_eq!(t.owner(Some("worker"), None).as_deref(), Some("worker"));
        // an admin's copy (a transfer from another cluster) names its owner too
        assert_eq!(
            t.owner(Some("admin"), Some("alice")).as_deref(),
            Some("alice")
        );
        assert_eq!(t.owner(None, Some("alice")), None);
        assert_eq!(t.owner(Some(""), Some("alice")), None);
    }

    #[test]
    fn only_the_owner_or_an_admin_cancels() {
        let t = trust("worker");
        assert!(t.may_cancel("alice", Some("alice")));
        assert!(t.may_cancel("admin", Some("alice")));
        assert!(t.may_cancel("admin", None));
        assert!(!t.may_cancel("mallory", Some("alice")));
        assert!(!t.may_cancel("mallory", None));
        // a forwarder is no admin
        assert!(!t.may_cancel("worker", Some("alice")));
    }

    #[test]
    fn compactions_come_from_ourselves_admins_and_peers_only() {
        let t = trust("worker");
        for u in ["worker", "admin", "gw2"] {
            assert!(t.may_compact(Some(u)), "{u}");
        }
        assert!(!t.may_compact(Some("mallory")));
        assert!(!t.may_compact(None));
        assert!(t.vouches_for_headers(Some("gw2")) && !t.vouches_for_headers(Some("mallory")));
        assert!(!t.is_forwarder(Some("admin")));
        let anonymous = Trust::new(Some(String::new()), &TrustSettings::default());
        assert_eq!(anonymous.own(), None);
        assert!(!anonymous.may_compact(Some("")));
    }
}
