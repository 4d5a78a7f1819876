-- The indexes pages, counts, purges and summaries read: pending and parked rows only, each
-- sorted by due time then owner (then row) within its equality prefix. A rebuild drops them
-- and makes them again here, by one sort each.
CREATE INDEX by_dest ON messages (listing, destination_id, due_ms, owner_id)
    WHERE listing IS NOT NULL;
CREATE INDEX by_owner ON messages (listing, owner_id, due_ms) WHERE listing IS NOT NULL;
CREATE INDEX by_due ON messages (listing, due_ms, owner_id) WHERE listing IS NOT NULL;
