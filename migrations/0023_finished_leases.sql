-- A lease can outlive its job by a moment: a completion, dead letter or cancel that finds the
-- key's semaphore row held by another transaction (an open producer transaction that enqueued a
-- job of the same key) no longer waits for it (a wait that outlasted the job's lease made the
-- finished job run again). It marks the lease finished instead (finished_at, NULL while the job
-- holds the permit), and the next transaction to hold the key's row gives the permit back: a
-- completion or enqueue of the key, or the sweep (docs/design.md §72). A nullable column without
-- a default, so adding it rewrites nothing, and code of before this migration, which never reads
-- it, keeps working. The partial index is what those transactions probe, by key: empty but for
-- the moment such a lease exists.
ALTER TABLE lockgate.leases ADD COLUMN IF NOT EXISTS finished_at timestamptz;
CREATE INDEX IF NOT EXISTS leases_finished_idx ON lockgate.leases (key) WHERE finished_at IS NOT NULL;
