//! The plugin-era application's scenarios, `plugin` and `proxy`: an application on plain AMQP
//! connections (no amqp-delay library) declares an `x-delayed-message` exchange, binds its queue
//! to it and publishes with `x-delay` at once, confirmed, and consumes the queue; on a broker
//! that runs the delayed-message-exchange plugin (`--plugin-url`), or through a `delay-proxy`
//! (`--proxy-url`, else one the bench starts from the binary beside its own, on a topology of
//! its own, `<prefix>-px`). Every pass declares its exchange anew, right before its first
//! publish: what it measures includes a new exchange's first messages.

use std::sync::Arc;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Confirmation, Connection};

use amqp_delay::broker::{self, ResultExt, SharedChannel};
use amqp_delay::{Error, Layout, Precision, Publisher, Result};

use super::Bench;
use super::Publishers;
use super::stage::{GATEWAY_KEY, Path};
use crate::amqp::{bind, connect, declare_delayed_exchange, delete_exchange, delete_queue};
use crate::cleanup::Cleanup;
use crate::config::Scenario;
use crate::proxy_process::ProxyProcess;
use crate::report::ScenarioResult;

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
    url: String,
    pub(super) admin: Connection,
    pub(super) consumer: Connection,
    /// Where what it declares is deleted from on Ctrl-C.
    pub(super) cleanup: Cleanup,
    plan: Option<(Layout, Precision)>,
}

impl AppEnd {
    async fn open(url: &str, cleanup: Cleanup, plan: Option<(Layout, Precision)>) -> Result<Self> {
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

    async fn close(&self) {
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

impl Bench<'_> {
    /// The `plugin` or `proxy` scenario.
    pub(super) async fn app(
        &mut self,
        sc: Scenario,
        raw_rate: Option<f64>,
        proxy_bin: Option<&std::path::Path>,
    ) -> Result<ScenarioResult> {
        let cfg = self.cfg;
        if sc == Scenario::Plugin {
            let url = cfg.plugin_url.clone().expect("validated: --plugin-url");
            let app = AppEnd::open(&url, self.cleanup.at(&url), None).await?;
            return self
                .app_passes(sc, app, None, Precision::EXACT, raw_rate)
                .await;
        }
        let settings = cfg.proxy_settings();
        let Some(bin) = proxy_bin else {
            // a running proxy, of settings unknown here
            let url = cfg.proxy_url.clone().expect("a proxy URL or binary");
            let app = AppEnd::open(&url, self.cleanup.clone(), None).await?;
            return self
                .app_passes(sc, app, None, settings.precision, raw_rate)
                .await;
        };
        let layout = settings.layout()?;
        // the tiers first: the proxy's gateway plans onto them
        self.declare(&layout).await?;
        let proxy = ProxyProcess::start(bin, &settings).await?;
        self.progress.note(&format!(
            "delay-proxy started (pid {}) for '{}'",
            proxy.pid().unwrap_or(0),
            layout.prefix()
        ));
        let plan = Some((layout.clone(), settings.precision));
        let r = match AppEnd::open(&proxy.url, self.cleanup.clone(), plan).await {
            Ok(app) => {
                self.app_passes(sc, app, Some(&layout), settings.precision, raw_rate)
                    .await
            }
            Err(e) => Err(e),
        };
        if let Some(p) = proxy.stop().await {
            self.problems.push(p);
        }
        let r = r?;
        self.check_empty(&layout).await;
        self.delete(&layout).await?;
        Ok(r)
    }

    /// The passes of an application scenario on `app`.
    async fn app_passes(
        &mut self,
        sc: Scenario,
        app: AppEnd,
        layout: Option<&Layout>,
        precision: Precision,
        raw_rate: Option<f64>,
    ) -> Result<ScenarioResult> {
        let app = Arc::new(app);
        let r = match self.app_publishers(&app).await {
            Ok(pubs) => {
                let path = Path::App(app.clone());
                let r = self
                    .scenario(sc, &pubs.pubs, layout, precision, raw_rate, &path)
                    .await;
                pubs.close().await;
                // the plugin plans nothing
                r.map(|mut r| {
                    if layout.is_none() {
                        r.precision = "n/a".into();
                    }
                    r
                })
            }
            Err(e) => Err(e),
        };
        app.close().await;
        r
    }

    /// `cfg.publishers` application channels to `app`, each on a connection of its own.
    async fn app_publishers(&self, app: &AppEnd) -> Result<Publishers> {
        let mut out = Publishers {
            pubs: Vec::new(),
            conns: Vec::new(),
        };
        for _ in 0..self.cfg.publishers {
            let conn = match connect(&app.url, "delay-bench application publisher").await {
                Ok(c) => Arc::new(c),
                Err(e) => {
                    out.close().await;
                    return Err(e);
                }
            };
            out.conns.push(conn.clone());
            let ch = match confirm_channel(&conn).await {
                Ok(ch) => ch,
                Err(e) => {
                    out.close().await;
                    return Err(e);
                }
            };
            out.pubs.push(Sender::Plain(ch, app.plan.clone()));
        }
        Ok(out)
    }
}

async fn confirm_channel(conn: &Connection) -> Result<SharedChannel> {
    let ch = broker::open(conn).await?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .context(|| "enabling publisher confirms".into())?;
    Ok(SharedChannel::new(ch))
}
