//! The plugin-era application's scenarios, `plugin` and `proxy`: an application on plain AMQP
//! connections (no amqp-delay library) declares an `x-delayed-message` exchange, binds its queue
//! to it and publishes with `x-delay` at once, confirmed, and consumes the queue; on a broker
//! that runs the delayed-message-exchange plugin (`--plugin-url`), or through a `delay-proxy`
//! (`--proxy-url`, else one the bench starts from the binary beside its own, on a topology of
//! its own, `<prefix>-px`). Every pass declares its exchange anew, right before its first
//! publish: what it measures includes a new exchange's first messages.

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Confirmation, Connection};

use amqp_delay::ops::broker::{self, ResultExt, SharedChannel};
use amqp_delay::{Error, Layout, Precision, Publisher, Result};

use crate::amqp::{bind, connect, declare_delayed_exchange, delete_exchange, delete_queue};
use crate::cleanup::Cleanup;

/// Who publishes in a pass: the library's publisher, or an application's confirm channel.
pub(crate) enum Sender {
    Library(Publisher),
    /// A plain channel in confirm mode, and the tiers the proxy plans its messages on (to
    /// count their hops; none for the plugin or a proxy of unknown settings).
    Plain(SharedChannel, Option<(Layout, Precision)>),
}

impl Sender {
    /// The library's publisher, which scheduling needs.
    pub(super) fn library(&self) -> Result<&Publisher> {
        match self {
            Sender::Library(p) => Ok(p),
            Sender::Plain(..) => Err(Error::Invalid(
                "an application's channel publishes, it does not schedule".into(),
            )),
        }
    }

    /// The hops a message delayed `delay_ms` is planned through alone (0 without tiers).
    pub(super) fn planned_hops(&self, delay_ms: u64) -> usize {
        match self {
            Sender::Library(p) => p.plan(delay_ms).map_or(0, |r| r.hops()),
            Sender::Plain(_, Some((layout, precision))) => {
                amqp_delay::plan(layout, precision, delay_ms).map_or(0, |r| r.hops())
            }
            Sender::Plain(_, None) => 0,
        }
    }

    /// Publishes and waits for the confirm (the library's: `mandatory` too; an application's:
    /// not, as plugin-era code publishes to a delayed exchange).
    pub(super) async fn publish_confirmed(
        &self,
        exchange: &str,
        key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<()> {
        let ch = match self {
            Sender::Library(p) => return p.publish_confirmed(exchange, key, body, props).await,
            Sender::Plain(ch, _) => ch,
        };
        let what = || format!("publishing to '{exchange}'");
        let confirm = ch
            .basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .context(what)?;
        match confirm.await.context(what)? {
            Confirmation::Ack(_) => Ok(()),
            _ => Err(Error::Nacked {
                exchange: exchange.to_string(),
            }),
        }
    }

    pub(super) async fn close(self) {
        match self {
            Sender::Library(p) => p.close().await,
            Sender::Plain(ch, _) => broker::close(&ch, "bye").await,
        }
    }
}

/// Where the application connects (the plugin's broker, or the proxy) and its connections
/// for declaring and consuming.
pub(crate) struct AppEnd {
    pub(super) url: String,
    pub(super) admin: Connection,
    pub(super) consumer: Connection,
    /// Where what it declares is deleted from on Ctrl-C.
    pub(super) cleanup: Cleanup,
    pub(super) plan: Option<(Layout, Precision)>,
}

impl AppEnd {
    pub(super) async fn open(
        url: &str,
        cleanup: Cleanup,
        plan: Option<(Layout, Precision)>,
    ) -> Result<Self> {
        let admin = connect(url, "delay-bench application").await?;
        let consumer = match connect(url, "delay-bench application consumer").await {
            Ok(c) => c,
            Err(e) => {
                broker::close_connection(&admin, "bye").await;
                return Err(e);
            }
        };
        Ok(AppEnd {
            url: url.to_string(),
            admin,
            consumer,
            cleanup,
            plan,
        })
    }

    pub(super) async fn close(&self) {
        broker::close_connection(&self.admin, "bye").await;
        broker::close_connection(&self.consumer, "bye").await;
    }

    /// The delayed exchange of the pass that measures `queue`.
    pub(super) fn exchange(queue: &str) -> String {
        format!("{queue}.x")
    }

    /// As the application starts: declares its delayed exchange and binds `queue` to it.
    pub(super) async fn declare(&self, queue: &str) -> Result<()> {
        let x = AppEnd::exchange(queue);
        self.cleanup.add_exchange(&x);
        declare_delayed_exchange(&self.admin, &x).await?;
        bind(&self.admin, queue, &x, GATEWAY_KEY).await
    }

    /// Deletes the pass's exchange (through the proxy: that ends its pair) and `queue`;
    /// returns what the queue still held.
    pub(super) async fn delete(&self, queue: &str) -> u32 {
        let x = AppEnd::exchange(queue);
        if delete_exchange(&self.admin, &x).await.is_ok() {
            self.cleanup.forget_exchange(&x);
        }
        match delete_queue(&self.admin, queue).await {
            Ok(n) => {
                self.cleanup.forget_queue(queue);
                n
            }
            Err(_) => 0, // Cleanup tries again at the end
        }
    }
}

/// Routing key of the gateway scenario's publishes (the target binding's key).
pub(super) const GATEWAY_KEY: &str = "bench";
