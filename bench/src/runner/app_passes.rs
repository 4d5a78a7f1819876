//! The application scenarios' passes (`plugin`, `proxy`): a plugin-era application's
//! connections publish to its delayed exchange and consume its queue.

use std::sync::Arc;

use lapin::Connection;
use lapin::options::ConfirmSelectOptions;

use amqp_delay::ops::broker::{self, ResultExt, SharedChannel};
use amqp_delay::{Layout, Precision, Result};

use super::Bench;
use super::Publishers;
use super::app::{AppEnd, Sender};
use super::stage::Path;
use crate::amqp::connect;
use crate::config::Scenario;
use crate::proxy_process::ProxyProcess;
use crate::report::ScenarioResult;

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
