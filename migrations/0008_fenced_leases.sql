-- Permits that hold under every schedule (issue 10). A claim renews (or re-acquires) the lease of
-- every limited job it returns and reports each delivery's budget; the heartbeat is fenced on the
-- delivery's token for the lease as for the message, never waits for a row lock, and reports
-- which deliveries it skipped. Both return types change, so sql/ recreates them.
DROP FUNCTION IF EXISTS lockgate.claim(text, integer, double precision, bigint);
DROP FUNCTION IF EXISTS lockgate.extend(text, bigint[], integer[], double precision);
DROP FUNCTION IF EXISTS lockgate._reacquire(text, bigint, integer, jsonb, jsonb);
DROP FUNCTION IF EXISTS lockgate._reacquire(text, lockgate._claimed, double precision);
DROP FUNCTION IF EXISTS lockgate._lock_key_now(text);
-- A prune no longer returns jobs to their queue; it reports how many are still in flight.
DROP FUNCTION IF EXISTS lockgate.prune_processes(double precision);

-- Lease renewals (claim, heartbeat, retry, shutdown return) rewrite expires_at on every
-- delivery; without an index on it they are HOT updates. The sweep that looks for expired leases
-- reads the whole table instead, which holds one row per permit held: small, and read once per
-- sweep interval.
DROP INDEX IF EXISTS lockgate.leases_expires_at_idx;

-- Bumped whenever a type's key paths change or it gains or loses its limit; a limited job's
-- message records the version its key was derived under (header kv, left out while 0), so a claim
-- can tell, without deriving the key again, that the job must take a permit of another key (H33).
ALTER TABLE lockgate.job_types ADD COLUMN concurrency_key_version integer NOT NULL DEFAULT 0;

-- A claimed delivery as lockgate.claim holds it while it decides a limited job whose lease is
-- gone (sql/020_claim.sql).
CREATE TYPE lockgate._claimed AS (
    msg_id      bigint,
    read_ct     integer,
    enqueued_at timestamptz,
    message     jsonb,
    headers     jsonb,
    vt          timestamptz
);
