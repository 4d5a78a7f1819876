//! The few pieces of `tests/it/harness.rs` the console's test needs (copied: each test binary
//! is a crate of its own): a real broker (the test FAILS loudly when none answers), a random
//! name prefix, a declared topology and queues, clean-up of everything it declared, a config
//! file for the binaries.

use amqp_delay::broker;
use amqp_delay::{Layout, Precision, Publisher, Settings, Topology, TopologySettings};
use lapin::Connection;
use lapin::options::QueueDeleteOptions;
use lapin::types::FieldTable;
use rand::Rng;

pub fn broker_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| amqp_delay::settings::DEFAULT_URL.into())
}

/// Connects or panics with a message saying how to get a broker.
pub async fn connect() -> Connection {
    match amqp_delay::connection::connect(&broker_url(), "amqp-delay tests").await {
        Ok(c) => c,
        Err(e) => panic!(
            "NO RABBITMQ BROKER: {e}\nThese tests need a real broker; run ./scripts/test.sh, which starts one."
        ),
    }
}

pub fn random_prefix() -> String {
    let n: u64 = rand::rng().random();
    format!("t{:012x}", n & 0xffff_ffff_ffff)
}

/// One test's world: its prefix, settings, declared topology and destination queues.
pub struct Env {
    pub settings: Settings,
    pub conn: Connection,
    queues: Vec<String>,
    declared: Vec<Layout>,
    cleaned: bool,
}

impl Drop for Env {
    /// A test that panicked did not reach `cleanup`: delete its objects anyway, on a fresh
    /// connection in a thread (the test's runtime may be gone).
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        let queues = std::mem::take(&mut self.queues);
        let declared = std::mem::take(&mut self.declared);
        with_fresh_connection(move |conn| async move {
            for q in &queues {
                if let Ok(ch) = conn.create_channel().await {
                    let _ = ch
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
            }
            for l in declared {
                delete_batch_markers(&conn, &l, &queues).await;
                // as cleanup does; the bare topology when the control stream cannot be read
                if amqp_delay_cli::admin::teardown(&conn, &l, None, true)
                    .await
                    .is_err()
                {
                    let _ = Topology::new(l).delete(&conn).await;
                }
            }
        });
    }
}

/// Deletes the batch and hold marker exchanges of each of `queues` under `layout` (absent ones are fine).
async fn delete_batch_markers(conn: &Connection, layout: &Layout, queues: &[String]) {
    let Ok(ch) = conn.create_channel().await else {
        return;
    };
    for q in queues {
        for x in layout.markers(q) {
            let _ = ch
                .exchange_delete(x.as_str().into(), Default::default())
                .await;
        }
    }
    let _ = ch.close(200, "bye".into()).await;
}

/// Runs `f` with a new connection on a new runtime in its own thread, and waits for it: for
/// clean-up in `Drop`, where the test's runtime may be gone. Does nothing without a broker.
pub fn with_fresh_connection<F, Fut>(f: F)
where
    F: FnOnce(Connection) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let _ = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            if let Ok(conn) = amqp_delay::connection::connect(&broker_url(), "test cleanup").await {
                f(conn).await;
            }
        });
    })
    .join();
}

impl Env {
    pub async fn new(topology: TopologySettings) -> Env {
        let settings = Settings {
            url: broker_url(),
            prefix: random_prefix(),
            topology,
            precision: Precision::EXACT,
            ..Settings::default()
        };
        let conn = connect().await;
        let mut env = Env {
            settings,
            conn,
            queues: Vec::new(),
            declared: Vec::new(),
            cleaned: false,
        };
        env.declare().await.expect("declare");
        env
    }

    pub fn layout(&self) -> Layout {
        self.settings.layout().unwrap()
    }

    pub async fn declare(&mut self) -> amqp_delay::Result<()> {
        let layout = self.layout();
        self.declared.push(layout.clone());
        Topology::new(layout).declare(&self.conn).await
    }

    pub async fn publisher(&self) -> Publisher {
        Publisher::connect(&self.settings).await.expect("publisher")
    }

    /// A destination queue named `<prefix>-<name>` (classic, durable), deleted on clean-up.
    pub async fn queue(&mut self, name: &str) -> String {
        let q = format!("{}-{name}", self.settings.prefix);
        self.declare_queue(&q).await;
        q
    }

    /// Declares exactly `q` (deleted on clean-up).
    pub async fn declare_queue(&mut self, q: &str) {
        let ch = broker::open(&self.conn).await.unwrap();
        broker::declare_queue(&ch, q, FieldTable::default())
            .await
            .unwrap();
        broker::close(&ch, "ok").await;
        self.queues.push(q.to_string());
    }

    pub async fn delete_queue(&self, q: &str) {
        let ch = self.conn.create_channel().await.unwrap();
        ch.queue_delete(q.into(), QueueDeleteOptions::default())
            .await
            .unwrap();
        let _ = ch.close(200, "ok".into()).await;
    }

    /// The worker's parking queue of `q`, deleted on clean-up.
    pub fn parked_queue(&mut self, q: &str) -> String {
        let parked = self.layout().parked_queue(q);
        self.track_queue(&parked);
        parked
    }

    /// Deletes everything this test declared.
    pub async fn cleanup(mut self) {
        for q in &self.queues {
            self.delete_queue(q).await;
        }
        for l in &self.declared {
            // the batch markers of this test's queues even if the control stream lost them (a
            // test that deleted it)
            delete_batch_markers(&self.conn, l, &self.queues).await;
            // as `delay-publisher teardown --force`: the topology and what the control stream
            // names (batch markers workers declared, gateway pairs)
            amqp_delay_cli::admin::teardown(&self.conn, l, None, true)
                .await
                .expect("teardown");
        }
        let _ = self.conn.close(200, "bye".into()).await;
        self.cleaned = true;
    }
}

impl Env {
    /// Also delete `q` on clean-up (queues the code under test declared, e.g. parking queues).
    pub fn track_queue(&mut self, q: &str) {
        self.queues.push(q.to_string());
    }

    /// Writes this test's settings, then `extra` TOML (sections of its own), as a config file
    /// for the binaries; returns its path.
    pub fn write_config(&self, extra: &str) -> std::path::PathBuf {
        let t = &self.settings.topology;
        let fixed: Vec<String> = t
            .fixed_levels
            .iter()
            .map(|f| f.as_millis().to_string())
            .collect();
        let text = format!(
            "prefix = \"{}\"\n[topology]\nradix = {}\nunit = {}\nmax_delay = {}\nfixed_levels = [{}]\nfixed_shards = {}\nmax_tier_ttl = {}\nqueue_type = \"{}\"\n{}\n[precision]\nlateness = {}\nlateness_ratio = {}\n\n{extra}\n",
            self.settings.prefix,
            t.radix,
            t.unit.as_millis(),
            t.max_delay.as_millis(),
            fixed.join(", "),
            t.fixed_shards,
            t.max_tier_ttl.as_millis(),
            t.queue_type,
            t.max_tier_length
                .map(|n| format!("max_tier_length = {n}"))
                .unwrap_or_default(),
            self.settings.precision.lateness.as_millis(),
            self.settings.precision.lateness_ratio,
        );
        let path = std::env::temp_dir().join(format!("{}.toml", self.settings.prefix));
        std::fs::write(&path, text).unwrap();
        path
    }
}

/// A temporary file path unique to this test.
pub fn temp_path(prefix: &str, name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{prefix}-{name}"))
}
