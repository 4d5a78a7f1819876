-- The pending index, version 1: one row per message, its history, the names rows share, the
-- header index and the follower's marks. Times are milliseconds since the epoch. The listing
-- indexes pages are read from are in 002_listing_indexes.sql (a rebuild drops and sorts them
-- again).

-- Owners, content types and destinations, each stored once. `kind`: 0 an owner, 1 a content
-- type (both in `name`, `routing_key` empty), 2 a destination (`name` its exchange, empty for
-- a queue; `routing_key` the queue's name or the message's routing key).
CREATE TABLE names (
    name_id INTEGER PRIMARY KEY,
    kind INTEGER NOT NULL,
    name TEXT NOT NULL,
    routing_key TEXT NOT NULL,
    UNIQUE (kind, name, routing_key)
);

-- One row per (owner, message id); a second schedule of the id replaces its fields.
-- `message_id`: a canonical UUID as its 16 bytes, any other id as text.
-- `state`: 0 unconfirmed, 1 pending, 2 cancelled, 3 done, 4 parked, 5 refused.
-- `listing`: 1 pending (or unconfirmed), 2 parked, NULL neither: what the listing indexes hold.
-- `finished_ms`: when it was cancelled or done (what expiry removes), NULL otherwise.
-- `events`: how many rows `history` holds for it. `headers`: the user headers, length-prefixed.
CREATE TABLE messages (
    row_id INTEGER PRIMARY KEY,
    owner_id INTEGER NOT NULL,
    message_id ANY NOT NULL,
    destination_id INTEGER NOT NULL,
    due_ms INTEGER NOT NULL,
    scheduled_ms INTEGER NOT NULL,
    body_bytes INTEGER NOT NULL,
    content_type_id INTEGER,
    state INTEGER NOT NULL,
    listing INTEGER,
    finished_ms INTEGER,
    events INTEGER NOT NULL,
    headers BLOB,
    body BLOB
);
CREATE UNIQUE INDEX by_id ON messages (owner_id, message_id);
CREATE INDEX by_fin ON messages (finished_ms) WHERE finished_ms IS NOT NULL;
CREATE INDEX by_unconfirmed ON messages (due_ms) WHERE state = 0;

-- One entry per indexed user header `k=v` of a pending row, keyed by the pair's hash.
CREATE TABLE header_index (
    header_hash INTEGER NOT NULL,
    due_ms INTEGER NOT NULL,
    owner_id INTEGER NOT NULL,
    row_id INTEGER NOT NULL,
    destination_id INTEGER NOT NULL,
    PRIMARY KEY (header_hash, due_ms, owner_id, row_id)
) WITHOUT ROWID;

-- What happened to a message beyond its first schedule, `seq` from 1. `kind`: 0 scheduled
-- (`to_due_ms`), 1 rescheduled by `by_user` (`from_due_ms` to `to_due_ms`), 2 cancelled by
-- `by_user`, 3 ran and done, 4 ran and retried (due again at `to_due_ms`), 5 ran and parked
-- (3 to 5 with `lateness_ms`).
CREATE TABLE history (
    row_id INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    at_ms INTEGER NOT NULL,
    by_user TEXT,
    lateness_ms INTEGER,
    from_due_ms INTEGER,
    to_due_ms INTEGER,
    PRIMARY KEY (row_id, seq)
) WITHOUT ROWID;

-- The follower's positions in its streams, and `rebuilding` while a rebuild is under way.
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
