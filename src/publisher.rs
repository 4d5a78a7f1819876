//! The confirmed publisher: plans a message's route, makes sure its destination is bound on the
//! delivery exchange (cached per process), and publishes it persistent, `mandatory` and with
//! publisher confirms. A nack or a return is an error for that message, never silent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use crate::broker::{self, NOT_FOUND};
use crate::error::{Error, Result, ResultExt};
use crate::headers;
use crate::layout::Layout;
use crate::message::{Message, Scheduled};
use crate::planner::{self, Precision, Route};
use crate::settings::{PublisherSettings, Settings};
use crate::time::now_ms;
use crate::topology::Topology;

/// Schedules messages. Cheap to share (`&Publisher` from many tasks); publishes are pipelined.
pub struct Publisher {
    conn: Arc<Connection>,
    owns_conn: bool,
    /// The confirm channel; replaced when the broker closed it (e.g. after a publish to a
    /// missing exchange), so one bad publish does not stop all later ones.
    channel: tokio::sync::RwLock<Channel>,
    admin: tokio::sync::Mutex<Option<Channel>>,
    layout: Layout,
    precision: Precision,
    settings: PublisherSettings,
    bound: Mutex<HashMap<String, Instant>>,
}

impl Publisher {
    /// Connects with `settings` and checks that the topology is declared with the same shape.
    pub async fn connect(settings: &Settings) -> Result<Publisher> {
        let layout = settings
            .layout()
            .map_err(crate::settings::SettingsError::from)?;
        let conn = crate::connection::connect(&settings.url, "amqp-delay publisher").await?;
        let mut p = Publisher::with_connection(
            Arc::new(conn),
            layout,
            settings.precision,
            settings.publisher.clone(),
        )
        .await?;
        p.owns_conn = true;
        Ok(p)
    }

    /// Uses an existing connection (not closed by [`Publisher::close`]).
    pub async fn with_connection(
        conn: Arc<Connection>,
        layout: Layout,
        precision: Precision,
        settings: PublisherSettings,
    ) -> Result<Publisher> {
        Topology::new(layout.clone()).verify(&conn).await?;
        let channel = open_confirm_channel(&conn).await?;
        Ok(Publisher {
            conn,
            owns_conn: false,
            channel: tokio::sync::RwLock::new(channel),
            admin: tokio::sync::Mutex::new(None),
            layout,
            precision,
            settings,
            bound: Mutex::new(HashMap::new()),
        })
    }

    /// The topology layout it publishes into.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The lateness budget it plans with.
    pub fn precision(&self) -> &Precision {
        &self.precision
    }

    /// The route a delay would take (no I/O).
    pub fn plan(&self, delay_ms: u64) -> Result<Route> {
        Ok(planner::plan(&self.layout, &self.precision, delay_ms)?)
    }

    /// Schedules one message; returns once the broker has confirmed it.
    pub async fn schedule(&self, msg: Message) -> Result<Scheduled> {
        self.layout
            .validate_destination(&msg.destination)
            .map_err(Error::Invalid)?;
        if msg.properties.expiration().is_some() {
            return Err(Error::Invalid(
                "the 'expiration' property is not allowed on a delayed message: it would expire inside a tier and be delivered early (docs/DESIGN.md rule 1); set it when the message is delivered instead".into(),
            ));
        }
        let route = self.plan(msg.delay_ms)?;
        let caller_headers = msg.properties.headers().clone().unwrap_or_default();
        let mut hdrs = headers::strip_death(&caller_headers);
        headers::check_not_reserved(&hdrs).map_err(Error::Invalid)?;
        self.ensure_bound(&msg.destination).await?;

        let due_at_ms = now_ms() + msg.delay_ms;
        headers::set_schedule_headers(&mut hdrs, msg.delay_ms, due_at_ms, msg.attempt);
        let message_id = match msg.properties.message_id() {
            Some(id) => id.to_string(),
            None => uuid::Uuid::now_v7().to_string(),
        };
        let props = msg
            .properties
            .with_message_id(message_id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(hdrs);
        let exchange = route.exchange(&self.layout);
        let key = route.routing_key(&self.layout, &msg.destination);
        self.publish_confirmed(&exchange, &key, &msg.body, props)
            .await?;
        Ok(Scheduled {
            message_id,
            due_at_ms,
            route,
        })
    }

    /// Schedules a stream of tagged messages with up to `publisher.max_in_flight` awaiting their
    /// confirm at once. Results come back as they complete (not in input order), with their tag.
    pub fn schedule_all<'a, T: 'a>(
        &'a self,
        items: impl Stream<Item = (T, Message)> + 'a,
    ) -> impl Stream<Item = (T, Result<Scheduled>)> + 'a {
        items
            .map(move |(tag, m)| async move { (tag, self.schedule(m).await) })
            .buffer_unordered(self.settings.max_in_flight)
    }

    /// Schedules a batch; results in input order.
    pub async fn schedule_batch(&self, msgs: Vec<Message>) -> Vec<Result<Scheduled>> {
        let n = msgs.len();
        let mut out: Vec<Option<Result<Scheduled>>> = (0..n).map(|_| None).collect();
        let mut s =
            std::pin::pin!(self.schedule_all(futures::stream::iter(msgs.into_iter().enumerate())));
        while let Some((i, r)) = s.next().await {
            out[i] = Some(r);
        }
        out.into_iter()
            .map(|r| r.expect("every message answered"))
            .collect()
    }

    /// Publishes with `mandatory` and waits for the confirm; nack and return are errors.
    /// Used for everything we (re-)publish, so callers strip `x-death` first.
    pub async fn publish_confirmed(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<()> {
        let key = ShortString::try_new(routing_key).map_err(|_| {
            Error::Invalid(format!(
                "routing key is {} bytes, more than 255",
                routing_key.len()
            ))
        })?;
        let channel = self.publish_channel().await?;
        let confirm = channel
            .basic_publish(
                exchange.into(),
                key,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                props,
            )
            .await
            .context(|| format!("publishing to '{exchange}'"))?
            .await
            .context(|| format!("awaiting the confirm from '{exchange}'"))?;
        if confirm.is_nack() {
            return Err(Error::Nacked {
                exchange: exchange.into(),
            });
        }
        if let Some(ret) = confirm.take_message() {
            return Err(Error::Returned {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
                code: ret.reply_code,
                text: ret.reply_text.to_string(),
            });
        }
        Ok(())
    }

    /// The confirm channel, reopened if the broker closed it.
    async fn publish_channel(&self) -> Result<Channel> {
        {
            let ch = self.channel.read().await;
            if ch.status().connected() {
                return Ok(ch.clone());
            }
        }
        let mut ch = self.channel.write().await;
        if !ch.status().connected() {
            tracing::info!("the publish channel was closed by the broker; reopening it");
            *ch = open_confirm_channel(&self.conn).await?;
        }
        Ok(ch.clone())
    }

    /// Binds `destination` on the delivery exchange unless it was bound recently by us.
    async fn ensure_bound(&self, destination: &str) -> Result<()> {
        let ttl = Duration::from_secs(self.settings.binding_cache_secs);
        let fresh = |map: &HashMap<String, Instant>| {
            map.get(destination).is_some_and(|t| t.elapsed() < ttl)
        };
        if fresh(&self.bound.lock().expect("binding cache")) {
            return Ok(());
        }
        let mut admin = self.admin.lock().await;
        if fresh(&self.bound.lock().expect("binding cache")) {
            return Ok(());
        }
        let ch = match admin.as_ref() {
            Some(c) if c.status().connected() => c.clone(),
            _ => {
                let c = self
                    .conn
                    .create_channel()
                    .await
                    .context(|| "opening the binding channel".into())?;
                *admin = Some(c.clone());
                c
            }
        };
        let exchange = self.layout.delivery_exchange();
        let pattern = self.layout.destination_binding(destination);
        match ch
            .queue_bind(
                destination.into(),
                exchange.as_str().into(),
                pattern.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
        {
            Ok(()) => {
                self.bound
                    .lock()
                    .expect("binding cache")
                    .insert(destination.to_string(), Instant::now());
                Ok(())
            }
            Err(e) => {
                *admin = None; // the broker closed the channel
                match broker::reply(&e) {
                    Some((NOT_FOUND, text)) if text.contains("no queue") => {
                        Err(Error::UnknownDestination(destination.into()))
                    }
                    Some((NOT_FOUND, _)) => Err(Error::NotDeclared {
                        prefix: self.layout.prefix().to_string(),
                        detail: format!(": the delivery exchange '{exchange}' is missing"),
                    }),
                    _ => Err(e).context(|| format!("binding destination '{destination}'")),
                }
            }
        }
    }

    /// Closes the channels (and the connection when we opened it).
    pub async fn close(self) {
        let _ = self.channel.read().await.close(200, "bye".into()).await;
        if let Some(c) = self.admin.lock().await.take() {
            let _ = c.close(200, "bye".into()).await;
        }
        if self.owns_conn {
            let _ = self.conn.close(200, "bye".into()).await;
        }
    }
}

async fn open_confirm_channel(conn: &Connection) -> Result<Channel> {
    let channel = conn
        .create_channel()
        .await
        .context(|| "opening the publish channel".into())?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .context(|| "enabling publisher confirms".into())?;
    Ok(channel)
}
