//! The command line of `delay-publisher`: its flags and subcommands (clap).

use std::path::PathBuf;

use amqp_delay::time::DurationMs;
use amqp_delay_cli::cli::GlobalArgs;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "delay-publisher",
    version,
    about = "Delayed delivery for RabbitMQ: declare the tier topology, schedule and inspect delayed messages"
)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) global: GlobalArgs,
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

#[derive(Subcommand)]
pub(crate) enum Cmd {
    /// Create (idempotently) every exchange, tier queue and binding
    Declare {
        /// Also make sure this destination queue exists (created durable, of the tiers' queue
        /// type, if missing) and is bound; repeatable
        #[arg(long = "queue", value_name = "QUEUE")]
        queues: Vec<String>,
        /// The --queue destinations are consumed by delay-consumer (or a library Worker): also
        /// declare their parking queues and batch markers (publishers then send them batches),
        /// so that workers need no right to configure anything
        #[arg(long, requires = "queues")]
        worker: bool,
    },
    /// Schedule one message, or many from a JSONL file
    Send(SendArgs),
    /// Cancel scheduled messages by id: no worker, gateway or relay runs or forwards them.
    /// Stops only the messages this user scheduled, unless it is in trust.admins
    Cancel(CancelArgs),
    /// Messages not yet due, and the depth of every tier queue and of the parking queue
    Stats {
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
        /// Only list queues holding messages
        #[arg(long)]
        non_empty: bool,
        /// Only the totals: messages not yet due (from the ledger) and broker messages, and
        /// when they fall due (with --json: one object)
        #[arg(long)]
        summary: bool,
    },
    /// Show the route a delay takes through the tiers (no broker needed)
    Plan {
        /// Delay: 1500 (ms), 30s, 1m30s, 24h ...
        delay: DurationMs,
    },
    /// Relay plugin-style messages: publish with an `x-delay` header (ms) to the ingress
    /// exchange, get them on the target exchange with their routing key after the delay.
    /// Declares what it needs; runs until SIGTERM/SIGINT
    Gateway(GatewayArgs),
    /// Move the delayed-message plugin's pending messages into amqp-delay (through the
    /// gateway pairs of their exchanges), nothing lost: each is deleted from the plugin only
    /// once its copy is confirmed. Reads the plugin's store with `rabbitmqctl eval`
    ImportPlugin(ImportArgs),
    /// See, retry and drop the messages parked in <prefix>.parked.<queue> (an admin's tool)
    #[command(subcommand)]
    Parked(ParkedCmd),
    /// See and steer what is scheduled and not yet run: list, show, purge, reschedule, cancel;
    /// `pending serve` keeps an index of it and serves it over HTTP
    #[command(subcommand)]
    Pending(PendingCmd),
    /// Recurring schedules: a cron expression whose every tick sends an ordinary delayed
    /// message. Kept in the control stream; a user sees and steers its own, an admin all
    #[command(subcommand)]
    Recurring(RecurringCmd),
    /// Move every message not yet run (tiers, fixed levels, batches, gateway due queues) from
    /// this cluster (--url) to another (--to), each due at its original time, nothing lost:
    /// an old message is acked only once its copy is confirmed on the new cluster
    Transfer(TransferArgs),
    /// Delete every exchange and queue of the topology, or with --queue one destination
    Teardown {
        /// Delete even if tiers or the parking queue still hold messages (they are lost)
        #[arg(long)]
        force: bool,
        /// Delete only destination queue QUEUE, its parking queue and its batch marker (the
        /// tiers stay); repeatable
        #[arg(long, value_name = "QUEUE")]
        queue: Vec<String>,
    },
}

#[derive(clap::Args)]
pub(crate) struct SendArgs {
    /// Destination queue (must exist)
    #[arg(long, required_unless_present = "jsonl", conflicts_with = "jsonl")]
    pub(crate) queue: Option<String>,
    /// Delay: 1500 (ms), 500ms, 30s, 1m30s, 24h ...
    #[arg(long, required_unless_present = "jsonl", allow_hyphen_values = true)]
    pub(crate) delay: Option<DurationMs>,
    /// Message body (text)
    #[arg(long, conflicts_with = "body_file")]
    pub(crate) body: Option<String>,
    /// Message body from a file, byte for byte ('-' for stdin)
    #[arg(long, value_name = "FILE", conflicts_with = "jsonl")]
    pub(crate) body_file: Option<PathBuf>,
    /// Message id (default: a generated UUID v7)
    #[arg(long)]
    pub(crate) id: Option<String>,
    /// Content type
    #[arg(long)]
    pub(crate) content_type: Option<String>,
    /// Header NAME=VALUE (string value), repeatable
    #[arg(long = "header", value_name = "NAME=VALUE")]
    pub(crate) headers: Vec<String>,
    /// Schedule one message per line of FILE ('-' for stdin): {"queue","delay_ms"|"delay","body","id","content_type","headers"}
    #[arg(long, value_name = "FILE")]
    pub(crate) jsonl: Option<PathBuf>,
    /// With --jsonl: where to write the lines that were not scheduled, ids filled in [default: FILE.unsent]
    #[arg(long, value_name = "FILE", requires = "jsonl")]
    pub(crate) unsent: Option<PathBuf>,
    /// With --jsonl: where to write the lines whose confirm was lost (they may have been delivered) [default: FILE.maybe-sent]
    #[arg(long, value_name = "FILE", requires = "jsonl")]
    pub(crate) maybe_sent: Option<PathBuf>,
}

#[derive(clap::Args)]
#[command(
    after_help = "A cancel confirmed at least cancel.notice (1s) before the due time is always honoured; give --due-at (the `due_at` that `send` printed) to learn whether it is in time, and to let the tombstone be forgotten sooner."
)]
pub(crate) struct CancelArgs {
    /// Message id to cancel
    #[arg(long, required_unless_present = "jsonl", conflicts_with = "jsonl")]
    pub(crate) id: Option<String>,
    /// Its due time (ms since the epoch, as `send` printed it)
    #[arg(long, requires = "id")]
    pub(crate) due_at: Option<u64>,
    /// Cancel one message per line of FILE ('-' for stdin): {"id": "...", "due_at": 1796...}
    #[arg(long, value_name = "FILE")]
    pub(crate) jsonl: Option<PathBuf>,
}

#[derive(clap::Args)]
#[command(
    after_help = "Pairs match in order: --ingress a --target x --ingress b --target y. Without flags, the pairs come from [[gateway.pairs]] in --config. Refused x-delay values and messages unroutable at the target are parked in <prefix>.parked.<prefix>.gw.due.<ingress>."
)]
pub(crate) struct GatewayArgs {
    /// Exchange applications publish to with `x-delay` (declared as a durable fanout); repeatable
    #[arg(long, value_name = "EXCHANGE")]
    pub(crate) ingress: Vec<String>,
    /// Existing exchange that receives the message when due, with its original routing key; one per --ingress
    #[arg(long, value_name = "EXCHANGE")]
    pub(crate) target: Vec<String>,
    /// Only declare the topology and the pairs, then exit: an admin's step, after which the
    /// gateway runs with least privilege (see README, "Security")
    #[arg(long)]
    pub(crate) declare_only: bool,
    /// Also serve every pair registered under the prefix while running (the control stream's
    /// records, e.g. delay-proxy's): `gateway.follow = true`
    #[arg(long)]
    pub(crate) follow_pairs: bool,
}

#[derive(clap::Args)]
#[command(
    after_help = "The plugin's node is reached with `rabbitmqctl eval` (the operator's own access; \
--url is the broker the copies go to: the same one, or a new cluster). The importing user must be the \
gateway's user or one of its trust.peers (the due stage delivers nothing else), and may write what a \
gateway writes. Exit code 1 when anything was left in the plugin (listed with its reason); \
messages due within --leave are left to the plugin, which delivers them itself."
)]
pub(crate) struct ImportArgs {
    /// Only the messages of this exchange (of --url's virtual host); repeatable [default: all]
    #[arg(long = "exchange", value_name = "NAME")]
    pub(crate) exchanges: Vec<String>,
    /// Count what would move (by exchange and due period); copy and delete nothing
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// The plugin's node, passed to rabbitmqctl as -n NAME [default: rabbitmqctl's own]
    #[arg(long, value_name = "NAME")]
    pub(crate) node: Option<String>,
    /// The command that runs rabbitmqctl, e.g. "kubectl exec -i rabbitmq-0 -- rabbitmqctl"
    #[arg(long, value_name = "CMD", default_value = "rabbitmqctl")]
    pub(crate) rabbitmqctl: String,
    /// Leave to the plugin what falls due within this (raised to three times the slowest call)
    #[arg(long, value_name = "DURATION", default_value = "10s")]
    pub(crate) leave: DurationMs,
    /// Entries read per rabbitmqctl call
    #[arg(long, value_name = "N", default_value_t = 4000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) batch: u32,
    /// Body bytes read per call, at most (a batch ends early past it)
    #[arg(long, value_name = "BYTES", default_value_t = 16 << 20)]
    pub(crate) batch_bytes: usize,
    /// Declare a missing gateway pair <prefix>.gw.x.<exchange> -> <exchange> (as delay-proxy
    /// does; served by gateways with --follow-pairs) instead of leaving its messages
    #[arg(long)]
    pub(crate) declare_pairs: bool,
    /// Longest a rabbitmqctl call may take
    #[arg(long, value_name = "DURATION", default_value = "5m")]
    pub(crate) call_timeout: DurationMs,
}

#[derive(clap::Args)]
#[command(
    after_help = "Run against the old cluster (--url, --prefix) with the new cluster's [trust]: the \
user of --to must be one of its admins or peers (a peer to move gateways' due queues), so that \
each copy names its owner; refused before anything moves otherwise. Cancelled, purged and superseded \
messages of the old cluster are not copied. Safe to interrupt and run again: what was copied but not \
acked is copied again (counted as possible duplicates). Exit code 1 when anything was left (listed \
with its reason)."
)]
pub(crate) struct TransferArgs {
    /// The new cluster's AMQP URL (several, comma-separated, are tried in turn)
    #[arg(long, value_name = "URL")]
    pub(crate) to: String,
    /// The new cluster's prefix [default: --prefix]
    #[arg(long, value_name = "PREFIX")]
    pub(crate) to_prefix: Option<String>,
    /// Only the messages to this destination queue (a gateway's: <prefix>.gw.due.<ingress>);
    /// repeatable [default: all]
    #[arg(long = "queue", value_name = "QUEUE")]
    pub(crate) queues: Vec<String>,
    /// Count what would move (by destination and due period); copy and ack nothing
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Also move the parked messages, each into the new cluster's parking queue of its
    /// destination with its parking headers and owner [default: counted, left]
    #[arg(long)]
    pub(crate) parked: bool,
    /// Broker messages (a batch is one) in hand per queue
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) prefetch: u16,
}

const PARKED_HELP: &str = "For the admin role: reading a parking queue needs `read` on it (and `configure` on \
<prefix>.parked-lock.*; retry also a publisher's rights), which the documented publisher and worker sets do not have. \
Every command reads the whole parking queue (at most 10000 messages) under a lock and gives back what it \
does not change, in its order; a second parked command on the same queue meanwhile is refused, and so is a \
queue with a consumer attached. \
Exit code 1 when an id is not found.";

/// Which parking queue a `parked` command reads.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
pub(crate) struct ParkedQueue {
    /// The destination queue whose parking queue <prefix>.parked.QUEUE to read
    #[arg(long, value_name = "QUEUE")]
    pub(crate) queue: Option<String>,
    /// Read <prefix>.parked: what no destination took
    #[arg(long)]
    pub(crate) unroutable: bool,
}

#[derive(Subcommand)]
pub(crate) enum ParkedCmd {
    /// One line per parked message, in queue order: position, id, reason, attempts, parked at, size
    #[command(after_help = PARKED_HELP)]
    List {
        #[command(flatten)]
        queue: ParkedQueue,
        /// Show at most N messages
        #[arg(long, value_name = "N", default_value_t = 1000)]
        limit: usize,
        /// One JSON object per line
        #[arg(long)]
        json: bool,
    },
    /// Every header and the whole body of one parked message (UTF-8, else base64)
    #[command(after_help = PARKED_HELP)]
    Show {
        /// Its message id
        id: String,
        #[command(flatten)]
        queue: ParkedQueue,
        /// One JSON object
        #[arg(long)]
        json: bool,
    },
    /// Schedule each message again to the queue it was parked from, attempt 0, then remove it
    /// from the parking queue once its copy is confirmed
    #[command(after_help = PARKED_HELP)]
    Retry {
        /// Message ids
        #[arg(required = true)]
        ids: Vec<String>,
        #[command(flatten)]
        queue: ParkedQueue,
        /// Deliver after this delay (1500, 30s, 1h ...)
        #[arg(long, default_value = "0")]
        delay: DurationMs,
    },
    /// Remove messages from the parking queue for good
    #[command(after_help = PARKED_HELP)]
    Drop {
        /// Message ids
        #[arg(required = true)]
        ids: Vec<String>,
        #[command(flatten)]
        queue: ParkedQueue,
        /// Do not ask (required when stdin is not a terminal)
        #[arg(long)]
        yes: bool,
    },
}

const PENDING_HELP: &str = "Answers come from a running `pending serve` when --index-url (pending.index_url) \
names one, asked as the user of --url; else the journal and the control stream are read into a temporary \
index for this command (fine at thousands pending). A user sees and steers only what it scheduled; \
trust.admins everything. Times: RFC 3339 (2026-12-24T18:00:00Z, ...+01:00), ms since the epoch, now, \
or from now (+10m, -1h).";

/// Where the `pending` commands get their answers.
#[derive(clap::Args)]
pub(crate) struct IndexSource {
    /// A running `pending serve` to ask (http://HOST:PORT) [config: pending.index_url]
    #[arg(long, value_name = "URL")]
    pub(crate) index_url: Option<String>,
}

/// Which messages a list or a purge covers.
#[derive(clap::Args)]
pub(crate) struct PendingFilter {
    /// Only due after this time
    #[arg(long, value_name = "TIME", value_parser = time_arg, allow_hyphen_values = true)]
    pub(crate) due_after: Option<u64>,
    /// Only due before this time
    #[arg(long, value_name = "TIME", value_parser = time_arg, allow_hyphen_values = true)]
    pub(crate) due_before: Option<u64>,
    /// Only with this user header
    #[arg(long, value_name = "NAME=VALUE", value_parser = header_arg)]
    pub(crate) header: Option<(String, String)>,
}

fn time_arg(s: &str) -> Result<u64, String> {
    amqp_delay_cli::pending::when::parse_time(s, amqp_delay::time::now_ms())
}

fn header_arg(s: &str) -> Result<(String, String), String> {
    amqp_delay_cli::pending::http::header_filter(s)
}

#[derive(Subcommand)]
pub(crate) enum PendingCmd {
    /// Pending messages by due time, one page (--after continues)
    #[command(after_help = PENDING_HELP)]
    List {
        /// Only messages to this queue
        #[arg(long, value_name = "QUEUE")]
        queue: Option<String>,
        #[command(flatten)]
        filter: PendingFilter,
        /// Messages a page holds (1 to 1000)
        #[arg(long, value_name = "N", default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..=1000))]
        limit: u16,
        /// Continue after this cursor (what the previous page printed as next)
        #[arg(long, value_name = "CURSOR")]
        after: Option<String>,
        /// Print the page as one JSON object
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        source: IndexSource,
    },
    /// Every field, the kept body and the history of one message
    #[command(after_help = PENDING_HELP)]
    Show {
        /// Its message id
        id: String,
        /// An admin: only the message of this owner
        #[arg(long, value_name = "USER")]
        owner: Option<String>,
        /// Print one JSON object
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        source: IndexSource,
    },
    /// Cancel every pending message of a queue (narrowed by the filters) with one record that
    /// every worker, relay and gateway honours like a cancel
    #[command(after_help = PENDING_HELP)]
    Purge {
        /// The destination queue
        #[arg(long, value_name = "QUEUE")]
        queue: String,
        /// An admin: only this owner's messages (default: everyone's)
        #[arg(long, value_name = "USER")]
        owner: Option<String>,
        #[command(flatten)]
        filter: PendingFilter,
        /// Do not ask (required when stdin is not a terminal)
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        source: IndexSource,
    },
    /// Move one pending message: later always; earlier or now only when its body was kept
    /// (journal.keep_body)
    #[command(after_help = PENDING_HELP)]
    Reschedule {
        /// Its message id
        id: String,
        /// Due this long from now (1500, 30s, 10m, 24h ...)
        #[arg(
            long,
            value_name = "DURATION",
            required_unless_present = "at",
            conflicts_with = "at"
        )]
        delay: Option<DurationMs>,
        /// Due at this time
        #[arg(long, value_name = "TIME", value_parser = time_arg, allow_hyphen_values = true)]
        at: Option<u64>,
        /// An admin: the message of this owner
        #[arg(long, value_name = "USER")]
        owner: Option<String>,
        #[command(flatten)]
        source: IndexSource,
    },
    /// Cancel one pending message by id, with its due time from the index
    #[command(after_help = PENDING_HELP)]
    Cancel {
        /// Its message id
        id: String,
        /// An admin: the message of this owner (an admin's cancel stops every owner's message of
        /// the id)
        #[arg(long, value_name = "USER")]
        owner: Option<String>,
        #[command(flatten)]
        source: IndexSource,
    },
    /// How far behind the index is
    Status {
        /// Print one JSON object
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        source: IndexSource,
    },
    /// Keep an index of what is pending (following the journal) and serve it over HTTP (the
    /// JSON API under /api/v1/, HTTP Basic logins checked by the broker); runs until SIGTERM
    Serve {
        /// Where to listen [config: pending.listen, default 127.0.0.1:8471]
        #[arg(long, value_name = "HOST:PORT")]
        listen: Option<String>,
        /// The index file (made, and rebuilt from the journal, when missing) [config: pending.index]
        #[arg(long, value_name = "PATH")]
        index: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
pub(crate) enum RecurringCmd {
    /// Add a schedule (or replace this user's schedule of the same name)
    #[command(
        after_help = "CRON: five fields (minute hour day-of-month month day-of-week), six with seconds first, or @yearly, @monthly, @weekly, @daily, @hourly. A wall time the clocks skip runs once at the change; one they repeat runs once, on its first pass."
    )]
    Add(RecurringAddArgs),
    /// This user's schedules (an admin's: everyone's), with their next tick, a page at a time
    /// by owner and name; when more follow, stderr names the --after of the next page
    #[command(after_help = RECURRING_READ_HELP)]
    List {
        /// Print JSON lines
        #[arg(long)]
        json: bool,
        /// Schedules a page shows (1 to 10000)
        #[arg(long, value_name = "N", default_value_t = 1000)]
        limit: usize,
        /// Start after this schedule (OWNER/NAME, as the page before named it)
        #[arg(long, value_name = "CURSOR")]
        after: Option<String>,
        #[command(flatten)]
        source: IndexSource,
    },
    /// One schedule and its next ticks
    #[command(after_help = RECURRING_READ_HELP)]
    Show {
        #[command(flatten)]
        name: RecurringName,
        #[command(flatten)]
        source: IndexSource,
    },
    /// No more occurrences until resumed (those already scheduled stay)
    Pause(RecurringName),
    /// Occurrences again, from the next tick on (the ticks while paused do not run)
    Resume(RecurringName),
    /// Remove a schedule (those already scheduled stay, as after pause)
    Remove(RecurringName),
    /// Send one occurrence now (named by this second), besides the ticks
    RunNow(RecurringName),
    /// Stop every occurrence of a schedule already scheduled and not yet run (a purge of its
    /// queue's messages carrying x-delay-recurring=NAME: honoured by our workers, gateways
    /// and relays)
    Purge(RecurringName),
    /// Publish this user's schedules' occurrences ahead, as this user, until SIGTERM/SIGINT.
    /// Run any number of replicas: one is active (it holds <prefix>.recurring.lock.<user>)
    Serve {
        /// Publish at least this far ahead (or up to the next tick, when later)
        #[arg(long, default_value = "1m")]
        ahead: DurationMs,
        /// A tick found unpublished later than this is missed (see --misfire)
        #[arg(long, default_value = "5s")]
        grace: DurationMs,
    },
}

/// Where `recurring list` and `show` read.
const RECURRING_READ_HELP: &str = "SOURCE: with --index-url (or pending.index_url) the running `pending serve` answers, as --url's user, from the schedules it follows live; without, this command replays the whole control stream (seconds at 100,000 schedules).";

#[derive(clap::Args)]
pub(crate) struct RecurringName {
    /// The schedule's name
    pub(crate) name: String,
    /// Whose schedule (an admin's command; default: this user's)
    #[arg(long)]
    pub(crate) owner: Option<String>,
    /// Print JSON (show)
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(clap::Args)]
pub(crate) struct RecurringAddArgs {
    /// The schedule's name (ASCII letters, digits, '.', '_', '-'; at most 100)
    pub(crate) name: String,
    /// When it ticks (see below)
    #[arg(long)]
    pub(crate) cron: String,
    /// The IANA time zone the cron is read in
    #[arg(long, default_value = "UTC")]
    pub(crate) tz: String,
    /// The destination queue of its occurrences (must exist)
    #[arg(long)]
    pub(crate) queue: String,
    /// Their body (text)
    #[arg(long, default_value = "")]
    pub(crate) body: String,
    /// Header NAME=VALUE (string value), repeatable
    #[arg(long = "header", value_name = "NAME=VALUE", value_parser = header_arg)]
    pub(crate) headers: Vec<(String, String)>,
    /// After an outage longer than the schedule-ahead window: one catch-up occurrence
    /// (once) or none (skip)
    #[arg(long, default_value = "once")]
    pub(crate) misfire: amqp_delay::recurring::Misfire,
    /// No tick before this time
    #[arg(long, value_name = "TIME", value_parser = time_arg, allow_hyphen_values = true)]
    pub(crate) from: Option<u64>,
    /// No tick after this time
    #[arg(long, value_name = "TIME", value_parser = time_arg, allow_hyphen_values = true)]
    pub(crate) until: Option<u64>,
}
