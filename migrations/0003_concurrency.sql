-- Concurrency limits: owned permits (leases), per-key semaphores, parked jobs, and the setting
-- that floors every lease. See sql/015_concurrency.sql for the functions that use them.

-- Functions whose signatures change in this version; sql/ recreates them.
DROP FUNCTION IF EXISTS lockgate.enqueue(text, jsonb, jsonb);
DROP FUNCTION IF EXISTS lockgate.enqueue_many(text, jsonb[], jsonb);
DROP FUNCTION IF EXISTS lockgate.define_job_type(text, text, smallint, integer, bigint, bigint, double precision, bigint);
DROP FUNCTION IF EXISTS lockgate.job_policy(text);
DROP FUNCTION IF EXISTS lockgate._resolve_options(lockgate.job_types, jsonb);

-- A job type's concurrency policy: at most concurrency_limit jobs per key hold a permit. The key
-- is the job type's name, followed by the values at concurrency_key's argument paths (dotted,
-- e.g. 'account.id'), unless an enqueue names the key explicitly.
ALTER TABLE lockgate.job_types
    ADD COLUMN concurrency_limit integer CHECK (concurrency_limit >= 1),
    ADD COLUMN concurrency_key text[],
    ADD COLUMN concurrency_duration_ms bigint NOT NULL DEFAULT 900000 CHECK (concurrency_duration_ms > 0),
    ADD COLUMN concurrency_on_conflict text NOT NULL DEFAULT 'block'
        CHECK (concurrency_on_conflict IN ('block', 'discard', 'raise'));

-- One row per key. Its row lock serialises everyone who takes, parks on or releases the key;
-- value is the number of live leases of the key at every commit.
CREATE TABLE lockgate.semaphores (
    key        text PRIMARY KEY,
    lim        integer NOT NULL CHECK (lim >= 1),
    value      integer NOT NULL CHECK (value >= 0),
    updated_at timestamptz NOT NULL DEFAULT now(),
    -- Every acquire checks value < lim under the row lock; this makes over-admission an error
    -- even if a future code path forgot to (G3).
    CONSTRAINT semaphores_within_limit CHECK (value <= lim)
);

-- A permit: owned by one message (queue, msg_id) for as long as its silence budget lasts.
-- Releasing deletes one's own row, so a duplicate or stale release finds nothing (G2).
CREATE TABLE lockgate.leases (
    queue       text NOT NULL,
    msg_id      bigint NOT NULL,
    key         text NOT NULL REFERENCES lockgate.semaphores (key),
    duration_ms bigint NOT NULL,
    expires_at  timestamptz NOT NULL,
    acquired_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, msg_id)
);
CREATE INDEX leases_key_idx ON lockgate.leases (key);
CREATE INDEX leases_expires_at_idx ON lockgate.leases (expires_at);

-- Jobs waiting for a permit of a full key. They leave only by promotion or an operator's
-- explicit discard; age never deletes them (G4). Arguments are stored as JSON objects (H8).
CREATE TABLE lockgate.parked (
    id        bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY,
    key       text NOT NULL,
    queue     text NOT NULL,
    job_type  text NOT NULL,
    job_id    bigint NOT NULL,
    args      jsonb NOT NULL CHECK (jsonb_typeof(args) = 'object'),
    headers   jsonb NOT NULL CHECK (jsonb_typeof(headers) = 'object'),
    priority  smallint NOT NULL,
    run_at    timestamptz NOT NULL,
    parked_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX parked_key_idx ON lockgate.parked (key, priority, id);
CREATE INDEX parked_parked_at_idx ON lockgate.parked (parked_at);

-- The heartbeat interval that floors every lease at twice its value (H10). Each runtime raises
-- it to its own interval at start; the largest wins, erring toward longer leases. Until a
-- runtime has started, the default heartbeat interval (5 s) applies.
CREATE TABLE lockgate.settings (
    singleton             boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    heartbeat_interval_ms bigint NOT NULL CHECK (heartbeat_interval_ms > 0)
);

-- A parked job that cannot be promoted (its type is gone) is dead-lettered without a message.
ALTER TABLE lockgate.dead_letters ALTER COLUMN msg_id DROP NOT NULL;
