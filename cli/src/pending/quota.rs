//! Each owner's quota of live purges and reschedules, checked at the moment of asking: the
//! workers hold at most so many of one owner's (`amqp_delay::ops::cancel`), so a request beyond is
//! refused here with the quota, how many are live and when they are over, rather than
//! written and skipped by every worker. The service follows the control stream as the workers
//! do (a [`Cancellations`] of its own user, which writes no checkpoint), syncs it to a barrier
//! before each check, and holds the check until the record is written, so that two requests
//! of one owner through one service do not both take its last place. An admin's are never
//! refused.

use amqp_delay::ops::cancel::{Cancellations, FollowOptions};
use amqp_delay::ops::connection::Connector;
use amqp_delay::settings::Settings;
use lapin::Connection;
use tokio::sync::{Mutex, MutexGuard};

/// Why a request was not let through.
#[derive(Debug)]
pub enum Refused {
    /// The owner holds its quota: how many are live and when they are over.
    Quota(String),
    /// The control stream could not be followed to check.
    Broker(amqp_delay::Error),
}

/// The follower a service checks quotas with, started at the first check.
pub struct Quotas {
    settings: Settings,
    follower: Mutex<Option<Following>>,
}

struct Following {
    cancels: Cancellations,
    conn: Connection,
}

/// A check passed: hold it until the record is written.
pub struct Passed<'a> {
    _held: Option<MutexGuard<'a, Option<Following>>>,
}

impl Passed<'_> {
    /// An admin's request: nothing to hold.
    pub fn admin() -> Passed<'static> {
        Passed { _held: None }
    }
}

/// What is checked.
#[derive(Debug, Clone, Copy)]
pub enum Ask<'a> {
    /// One more purge.
    Purge,
    /// A reschedule of message `id` (moving one of the owner's own again replaces it).
    Reschedule(&'a str),
}

impl Quotas {
    /// Checks with the control stream of `settings`' broker, read as its user (which needs
    /// read and write on `P.control`: `pending serve`'s and the console's own user).
    pub fn new(settings: Settings) -> Quotas {
        Quotas {
            settings,
            follower: Mutex::new(None),
        }
    }

    /// Whether `user` (no admin) may write what it asks now: [`Refused::Quota`] says why not.
    pub async fn check(&self, user: &str, ask: Ask<'_>) -> Result<Passed<'_>, Refused> {
        let mut held = self.follower.lock().await;
        // a follower that stopped (its connection lost) is started again, once
        let synced = match held.as_ref() {
            Some(f) => f.cancels.sync().await.is_ok(),
            None => false,
        };
        if !synced {
            if let Some(old) = held.take() {
                old.stop().await;
            }
            *held = Some(self.start().await.map_err(Refused::Broker)?);
        }
        let cancels = &held.as_ref().expect("started above").cancels;
        let r = match ask {
            Ask::Purge => cancels.may_purge(user),
            Ask::Reschedule(id) => cancels.may_reschedule(user, id),
        };
        r.map_err(Refused::Quota)?;
        Ok(Passed { _held: Some(held) })
    }

    async fn start(&self) -> Result<Following, amqp_delay::Error> {
        let s = &self.settings;
        let layout = s.layout().map_err(amqp_delay::Error::from)?;
        let conn = Connector::new(s)?
            .connect("amqp-delay pending quota")
            .await?;
        let mut opts =
            FollowOptions::new(s.cancel.notice.as_duration(), s.cancel.horizon.as_millis());
        opts.trust = s.trust.clone();
        // it only reads: the workers' checkpoints count, its own would not
        opts.checkpoint_every = u64::MAX;
        match Cancellations::follow_with(&conn, &layout, opts).await {
            Ok(cancels) => Ok(Following { cancels, conn }),
            Err(e) => {
                amqp_delay::ops::broker::close_connection(&conn, "bye").await;
                Err(e)
            }
        }
    }
}

impl Following {
    async fn stop(self) {
        let Following { cancels, conn } = self;
        drop(cancels);
        amqp_delay::ops::broker::close_connection(&conn, "bye").await;
    }
}
