//! Which gateway pair delivers a plugin exchange's messages: a configured pair whose target is
//! the exchange, else the pair registered in the control stream (`delay-proxy`'s
//! `<prefix>.gw.x.<exchange>` first), else — with `--declare-pairs` — that pair declared now
//! with the gateway's own declare, as `delay-proxy` declares it. Each exchange is looked up once.

use std::collections::HashMap;

use amqp_delay::gateway::{Gateway, Pair};
use amqp_delay::ops::control::{self, Record};
use amqp_delay::settings::PairConfig;
use amqp_delay::{Layout, Settings};
use amqp_delay::{Result, error_chain as chain};
use lapin::Connection;

/// The pairs known and the answers given so far.
pub(super) struct Pairs {
    settings: Settings,
    layout: Layout,
    /// Pairs by target: configured, then registered (ended ones left out).
    known: Vec<PairConfig>,
    /// Declare a missing pair (`--declare-pairs`; never in a dry run).
    declare: bool,
    dry_run: bool,
    answers: HashMap<String, std::result::Result<Pair, String>>,
}

impl Pairs {
    /// Reads the registered pairs from the control stream.
    pub(super) async fn load(
        conn: &Connection,
        settings: &Settings,
        declare: bool,
        dry_run: bool,
    ) -> Result<Pairs> {
        let layout = settings
            .layout()
            .map_err(amqp_delay::settings::SettingsError::from)?;
        let mut known = settings.gateway.pairs.clone();
        for r in control::read_all(conn, &layout, &settings.trust).await? {
            if let Record::GatewayPair {
                ingress, target, ..
            } = r
            {
                known.push(PairConfig {
                    ingress,
                    target,
                    writers: Vec::new(),
                });
            }
        }
        Ok(Pairs {
            settings: settings.clone(),
            layout,
            known,
            declare,
            dry_run,
            answers: HashMap::new(),
        })
    }

    /// The pair of `exchange`, or why its messages cannot move.
    pub(super) async fn pair_for(
        &mut self,
        conn: &Connection,
        exchange: &str,
    ) -> std::result::Result<Pair, String> {
        if let Some(a) = self.answers.get(exchange) {
            return a.clone();
        }
        let a = match self.find(conn, exchange).await {
            Ok(a) => a,
            Err(e) => Err(format!(
                "looking up the pair of exchange '{exchange}': {}",
                chain(&e)
            )),
        };
        self.answers.insert(exchange.to_string(), a.clone());
        a
    }

    async fn find(
        &self,
        conn: &Connection,
        exchange: &str,
    ) -> Result<std::result::Result<Pair, String>> {
        if exchange.is_empty() || !amqp_delay::ops::broker::exchange_exists(conn, exchange).await? {
            return Ok(Err(format!(
                "exchange '{exchange}' does not exist on the target broker (the plugin would drop \
                 these when due): declare it with its bindings, then run the import again"
            )));
        }
        let proxy = self.layout.proxy_ingress(exchange);
        let cfg = self
            .known
            .iter()
            .filter(|p| p.target == exchange)
            .min_by_key(|p| p.ingress != proxy);
        let cfg = match cfg {
            Some(c) => c.clone(),
            None if self.declare => PairConfig {
                ingress: proxy.clone(),
                target: exchange.to_string(),
                writers: Vec::new(),
            },
            None => {
                return Ok(Err(format!(
                    "no gateway pair delivers to exchange '{exchange}': run `delay-publisher \
                     gateway --declare-only --ingress {proxy} --target {exchange}` (or this \
                     command with --declare-pairs), with a gateway running --follow-pairs"
                )));
            }
        };
        let pair = match Pair::new(&self.layout, &cfg) {
            Ok(p) => p,
            Err(e) => return Ok(Err(e)),
        };
        self.ready(conn, pair, &cfg).await
    }

    /// `pair` once its due queue exists (declared with the gateway's declare when it is missing
    /// and `--declare-pairs` asks for it).
    async fn ready(
        &self,
        conn: &Connection,
        pair: Pair,
        cfg: &PairConfig,
    ) -> Result<std::result::Result<Pair, String>> {
        let due = amqp_delay::ops::broker::queue_state(conn, &pair.due_queue).await?;
        let state = match due {
            Some(s) => s,
            None if self.dry_run && self.declare => return Ok(Ok(pair)),
            None if self.declare => {
                let mut settings = self.settings.clone();
                settings.gateway.pairs = vec![cfg.clone()];
                Gateway::new(settings)?.declare(conn).await?;
                tracing::info!(ingress = %pair.ingress, target = %pair.target, "declared the gateway pair");
                return Ok(Ok(pair));
            }
            None => {
                return Ok(Err(format!(
                    "the due queue '{}' of pair '{}' -> '{}' does not exist: run `delay-publisher \
                     gateway --declare-only --ingress {} --target {}`",
                    pair.due_queue, pair.ingress, pair.target, pair.ingress, pair.target
                )));
            }
        };
        if state.consumers == 0 {
            tracing::warn!(queue = %pair.due_queue, target = %pair.target, "no gateway consumes this pair's due queue: imported messages wait there until one does (`delay-publisher gateway --follow-pairs`)");
        }
        Ok(Ok(pair))
    }
}
