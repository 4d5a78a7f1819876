//! Who may deliver through a gateway pair. The gateway publishes to a pair's target under its
//! own user, so whoever can put a message into the pair's ingress reaches the target: an
//! ingress message is delivered only when its writer (its broker-checked `user_id`) is one of
//! the pair's writers or an admin (`trust.admins`). A pair's writers come from its
//! configuration ([`crate::settings::PairConfig::writers`]) or, for a pair served from the
//! control stream, from its [`Record::GatewayPair`] records since its last end (`delay-proxy`
//! names the client that declared the exchange: the broker let it configure the target). A
//! pair that names none is open: every user the broker lets write its ingress.
//!
//! A record is appended before the client that asked for it hears back, but the gateway reads
//! it a little later: a writer not known yet makes the handler read the control stream up to
//! a barrier of its own ([`Writers::sync`]) before it decides, so a writer registered before
//! its message was published is never turned away.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::control::Record;
use crate::error::{Error, Result};
use crate::trust::Trust;

/// Who may deliver through one pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Allowed {
    /// Every user the broker lets write the ingress.
    Anyone,
    /// These users (and admins).
    Users(BTreeSet<String>),
}

impl Allowed {
    /// The writers a configuration or one record names.
    fn of(writers: &[String]) -> Allowed {
        if writers.is_empty() {
            Allowed::Anyone
        } else {
            Allowed::Users(writers.iter().cloned().collect())
        }
    }

    /// Both together (a second record of a pair adds its writers).
    fn and(self, other: Allowed) -> Allowed {
        match (self, other) {
            (Allowed::Users(mut a), Allowed::Users(b)) => {
                a.extend(b);
                Allowed::Users(a)
            }
            _ => Allowed::Anyone,
        }
    }
}

/// Whether a message written by `writer` (its `user_id`; `None` without one) may go through
/// the pair of `ingress` to `target`, whose writers are `allowed` (`None`: no record or
/// configuration names the pair), or why not.
pub(crate) fn check(
    allowed: Option<&Allowed>,
    writer: Option<&str>,
    trust: &Trust,
    ingress: &str,
    target: &str,
) -> std::result::Result<(), String> {
    let Some(allowed) = allowed else {
        return Err(format!(
            "gateway pair '{ingress}' → '{target}' is not registered (ended?)"
        ));
    };
    let users = match allowed {
        Allowed::Anyone => return Ok(()),
        Allowed::Users(users) => users,
    };
    match writer {
        Some(w) if users.contains(w) || trust.is_admin(w) => Ok(()),
        Some(w) => Err(format!(
            "written by '{w}', who may not deliver to exchange '{target}' through ingress \
             '{ingress}' (its writers: {}; admins: trust.admins)",
            users.iter().cloned().collect::<Vec<_>>().join(", ")
        )),
        None => Err(format!(
            "no user_id: the gateway cannot tell who wrote it, and only its writers ({}) may \
             deliver to exchange '{target}' through ingress '{ingress}' (publish with the \
             user_id property, or through delay-proxy, which sets it)",
            users.iter().cloned().collect::<Vec<_>>().join(", ")
        )),
    }
}

/// How long a handler waits for its barrier to be read back before it gives the message back
/// to the ingress queue (tried again later).
const SYNC_TIMEOUT: Duration = Duration::from_secs(10);

/// The writers of the pairs a gateway serves, by ingress: configured ones fixed, followed
/// ones kept current by the follower of the control stream ([`Writers::note`]).
#[derive(Debug, Default)]
pub(crate) struct Writers {
    fixed: HashMap<String, Allowed>,
    followed: Mutex<HashMap<String, Allowed>>,
    /// Barriers appended by handlers, waiting for the follower to read them back.
    waiting: Mutex<HashMap<String, oneshot::Sender<()>>>,
    /// Whether a follower reads the control stream (`gateway.follow`): only then can a writer
    /// not known yet become known.
    following: bool,
    /// One sync at a time; when the last one started (ms since the epoch).
    synced: tokio::sync::Mutex<u64>,
}

impl Writers {
    /// The writers of the configured pairs `configured` (ingress, writers); `following` when a
    /// follower will feed [`Writers::note`] the control stream's records.
    pub(crate) fn new<'a>(
        configured: impl IntoIterator<Item = (&'a str, &'a [String])>,
        following: bool,
    ) -> Writers {
        Writers {
            fixed: configured
                .into_iter()
                .map(|(i, w)| (i.to_string(), Allowed::of(w)))
                .collect(),
            following,
            ..Writers::default()
        }
    }

    /// Who may deliver through the pair of `ingress` now.
    pub(crate) fn allowed(&self, ingress: &str) -> Option<Allowed> {
        if let Some(a) = self.fixed.get(ingress) {
            return Some(a.clone());
        }
        lock(&self.followed).get(ingress).cloned()
    }

    /// A record of the control stream, from a writer the follower trusts: a pair's record
    /// adds its writers, its end forgets them, a barrier wakes the handler that appended it.
    pub(crate) fn note(&self, record: &Record) {
        match record {
            Record::GatewayPair {
                ingress, writers, ..
            } if !self.fixed.contains_key(ingress) => {
                let mut map = lock(&self.followed);
                let now = match map.remove(ingress) {
                    Some(a) => a.and(Allowed::of(writers)),
                    None => Allowed::of(writers),
                };
                map.insert(ingress.clone(), now);
            }
            Record::GatewayPairEnded { ingress, .. } => {
                lock(&self.followed).remove(ingress);
            }
            Record::Barrier { nonce } => {
                if let Some(tx) = lock(&self.waiting).remove(nonce) {
                    let _ = tx.send(());
                }
            }
            _ => {}
        }
    }

    /// Makes sure every pair record confirmed before `since` (ms since the epoch) has been
    /// read: appends a barrier with `append` and waits until the follower reads it back,
    /// unless a sync that started at `since` or later already did. `Ok(false)` when nothing
    /// can change (no follower).
    pub(crate) async fn sync<F>(&self, since: u64, append: F) -> Result<bool>
    where
        F: AsyncFnOnce(Record) -> Result<()>,
    {
        if !self.following {
            return Ok(false);
        }
        let mut last = self.synced.lock().await;
        if *last >= since {
            return Ok(true);
        }
        let started = crate::time::now_ms();
        let nonce = crate::stream_log::nonce();
        let (tx, rx) = oneshot::channel();
        lock(&self.waiting).insert(nonce.clone(), tx);
        let appended = append(Record::Barrier {
            nonce: nonce.clone(),
        })
        .await;
        let read = match appended {
            Ok(()) => tokio::time::timeout(SYNC_TIMEOUT, rx).await,
            Err(e) => {
                lock(&self.waiting).remove(&nonce);
                return Err(e);
            }
        };
        lock(&self.waiting).remove(&nonce);
        match read {
            Ok(Ok(())) => {
                *last = started;
                Ok(true)
            }
            _ => Err(Error::Stopped(format!(
                "the gateway's follower did not read its barrier back within {SYNC_TIMEOUT:?}"
            ))),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::TrustSettings;

    fn trust() -> Trust {
        Trust::new(
            Some("gw".into()),
            &TrustSettings {
                admins: vec!["admin".into()],
                peers: vec!["gw2".into()],
                ..Default::default()
            },
        )
    }

    fn pair(ingress: &str, writers: &[&str]) -> Record {
        Record::GatewayPair {
            ingress: ingress.into(),
            target: "t".into(),
            writers: writers.iter().map(|w| w.to_string()).collect(),
            vhost: None,
        }
    }

    #[test]
    fn only_a_pairs_writers_and_admins_deliver_through_it() {
        let t = trust();
        let w = Writers::new([("static", &[][..])], true);
        w.note(&pair("i", &["a"]));
        let a = w.allowed("i");
        assert!(check(a.as_ref(), Some("a"), &t, "i", "t").is_ok());
        assert!(check(a.as_ref(), Some("admin"), &t, "i", "t").is_ok());
        let e = check(a.as_ref(), Some("b"), &t, "i", "t").unwrap_err();
        assert!(
            e.contains("written by 'b'") && e.contains("writers: a"),
            "{e}"
        );
        // the gateway and its peers are no writers of an application's pair
        for u in ["gw", "gw2"] {
            assert!(check(a.as_ref(), Some(u), &t, "i", "t").is_err(), "{u}");
        }
        let e = check(a.as_ref(), None, &t, "i", "t").unwrap_err();
        assert!(e.contains("no user_id"), "{e}");
        // a second record adds its writer
        w.note(&pair("i", &["a2"]));
        assert!(check(w.allowed("i").as_ref(), Some("a2"), &t, "i", "t").is_ok());
        // a pair nobody names is open; an unknown one is not served
        assert!(check(w.allowed("static").as_ref(), None, &t, "static", "t").is_ok());
        assert!(check(w.allowed("x").as_ref(), Some("a"), &t, "x", "t").is_err());
    }

    #[test]
    fn an_end_forgets_the_writers_and_configuration_wins() {
        let w = Writers::new([("c", &["ops".to_string()][..])], true);
        w.note(&pair("i", &["a"]));
        w.note(&Record::GatewayPairEnded {
            ingress: "i".into(),
            target: "t".into(),
            by: None,
            vhost: None,
        });
        assert_eq!(w.allowed("i"), None);
        w.note(&pair("i", &["b"]));
        assert_eq!(
            w.allowed("i"),
            Some(Allowed::Users(["b".to_string()].into()))
        );
        // records cannot widen a configured pair
        w.note(&pair("c", &[]));
        assert_eq!(
            w.allowed("c"),
            Some(Allowed::Users(["ops".to_string()].into()))
        );
        // an open record opens a followed pair (an operator's declare)
        w.note(&pair("i", &[]));
        assert_eq!(w.allowed("i"), Some(Allowed::Anyone));
    }

    #[tokio::test]
    async fn a_sync_waits_for_its_barrier_and_only_with_a_follower() {
        let none = Writers::new([], false);
        let appended = none.sync(1, async |_| Ok(())).await;
        assert!(!appended.unwrap(), "nothing can change without a follower");
        let w = std::sync::Arc::new(Writers::new([], true));
        let w2 = w.clone();
        let synced = w
            .sync(crate::time::now_ms(), async move |r| {
                // the follower reads the record the handler appended, and a pair before it
                w2.note(&pair("i", &["late"]));
                w2.note(&r);
                Ok(())
            })
            .await;
        assert!(synced.unwrap());
        assert!(w.allowed("i").is_some());
        // a sync that started later serves an earlier need without another barrier
        let again = w.sync(1, async |_| panic!("no second barrier")).await;
        assert!(again.unwrap());
    }
}
