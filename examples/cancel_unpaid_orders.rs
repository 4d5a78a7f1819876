//! "Cancel unpaid orders after N minutes" — the scenario amqp-delay exists for.
//!
//! Orders live in an embedded SQLite database. Creating an order schedules a delayed message to
//! the queue `orders.timeout`; when it falls due, the worker cancels the order only if it is
//! still unpaid (one conditional UPDATE: idempotent, so a redelivered message is harmless).
//!
//! ```sh
//! cargo run --example cancel_unpaid_orders -- create --amount 42 --after 1m   # prints the id
//! cargo run --example cancel_unpaid_orders -- pay 1
//! cargo run --example cancel_unpaid_orders -- worker      # Ctrl-C to stop
//! cargo run --example cancel_unpaid_orders -- list
//! ```
//! Global flags as for the binaries (`--url`, `--prefix`, `--config`) plus `--db FILE`
//! (default `orders.db`).

use std::path::PathBuf;
use std::sync::Mutex;

use amqp_delay::time::DurationMs;
use amqp_delay::{
    Context, Delivery, Handler, Message, Outcome, Publisher, Settings, Topology, Worker,
};
use clap::{Parser, Subcommand};

const QUEUE: &str = "orders.timeout";

#[derive(Parser)]
struct Args {
    /// TOML configuration file; AMQP_DELAY_* variables (e.g. AMQP_DELAY_URL) override it
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// SQLite database file
    #[arg(long, default_value = "orders.db")]
    db: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create an unpaid order and schedule its timeout
    Create {
        #[arg(long)]
        amount: u64,
        /// Cancel it if still unpaid after this long
        #[arg(long, default_value = "30m")]
        after: DurationMs,
    },
    /// Mark an order paid
    Pay { id: i64 },
    /// Cancel orders whose timeout fell due while still unpaid
    Worker,
    /// Show all orders
    List,
}

fn open(db: &PathBuf) -> rusqlite::Connection {
    let c = rusqlite::Connection::open(db).expect("open database");
    c.execute_batch(
        "CREATE TABLE IF NOT EXISTS orders (
            id INTEGER PRIMARY KEY, amount INTEGER NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('unpaid', 'paid', 'cancelled')))",
    )
    .expect("create table");
    c
}

/// Cancels the order named in the body if, and only if, it is still unpaid.
struct CancelIfUnpaid(Mutex<rusqlite::Connection>);

impl Handler for CancelIfUnpaid {
    async fn handle(&self, d: &Delivery, _ctx: &Context) -> Outcome {
        let id: i64 = match serde_json::from_slice::<serde_json::Value>(&d.body)
            .ok()
            .and_then(|v| v["order"].as_i64())
        {
            Some(id) => id,
            None => return Outcome::Permanent("body is not {\"order\": <id>}".into()),
        };
        let db = self.0.lock().expect("db lock");
        match db.execute(
            "UPDATE orders SET status = 'cancelled' WHERE id = ?1 AND status = 'unpaid'",
            [id],
        ) {
            Ok(1) => println!("order {id}: cancelled (unpaid after its timeout)"),
            Ok(_) => println!("order {id}: nothing to do (paid, already cancelled or unknown)"),
            Err(e) => return Outcome::Retry(format!("database: {e}")), // e.g. locked: try later
        }
        Outcome::Success
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let settings = Settings::load(args.config.as_deref())?;
    settings.validate()?;
    match args.cmd {
        Cmd::Create { amount, after } => {
            let conn = amqp_delay::connect(&settings.url, "orders example").await?;
            let topo = Topology::new(settings.layout()?);
            topo.declare(&conn).await?;
            topo.declare_destination(&conn, QUEUE).await?;
            let db = open(&args.db);
            db.execute(
                "INSERT INTO orders (amount, status) VALUES (?1, 'unpaid')",
                [amount as i64],
            )?;
            let id = db.last_insert_rowid();
            let publisher = Publisher::connect(&settings).await?;
            let body = serde_json::json!({ "order": id }).to_string();
            let s = publisher
                .schedule(
                    Message::new(QUEUE, after.as_millis(), body)
                        .with_id(format!("order-{id}-timeout"))
                        .with_content_type("application/json"),
                )
                .await?;
            println!(
                "order {id} created; cancelled at {} ms unless paid",
                s.due_at_ms
            );
            publisher.close().await;
        }
        Cmd::Pay { id } => {
            let n = open(&args.db).execute(
                "UPDATE orders SET status = 'paid' WHERE id = ?1 AND status = 'unpaid'",
                [id],
            )?;
            println!("order {id}: {}", if n == 1 { "paid" } else { "not unpaid" });
        }
        Cmd::List => {
            let db = open(&args.db);
            let mut st = db.prepare("SELECT id, amount, status FROM orders ORDER BY id")?;
            let rows = st.query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })?;
            for row in rows {
                let (id, amount, status) = row?;
                println!("{id}\t{amount}\t{status}");
            }
        }
        Cmd::Worker => {
            let conn = amqp_delay::connect(&settings.url, "orders example").await?;
            let topo = Topology::new(settings.layout()?);
            topo.declare(&conn).await?;
            topo.declare_destination(&conn, QUEUE).await?;
            let handler = CancelIfUnpaid(Mutex::new(open(&args.db)));
            Worker::new(settings)
                .subscribe(QUEUE, handler)
                .run(async {
                    let _ = tokio::signal::ctrl_c().await;
                })
                .await?;
        }
    }
    Ok(())
}
