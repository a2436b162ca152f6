-- lockgate's tables. Forward-only: a later change is a new numbered file, never an edit here.
-- Functions live in sql/ and are re-applied on every migrate.

CREATE SCHEMA IF NOT EXISTS lockgate;

-- Queues lockgate manages. Every row has its PGMQ pair pgmq.q_<name> / pgmq.a_<name>, created in
-- the same transaction by lockgate.create_queue. The name rule matches QueueName in lockgate-core.
CREATE TABLE lockgate.queues (
    name       text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_]{0,46}$'),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Job types and their policies, so that SQL producers get the same semantics as Rust producers.
CREATE TABLE lockgate.job_types (
    name            text PRIMARY KEY CHECK (name ~ '^[A-Za-z][A-Za-z0-9_.:-]{0,127}$'),
    queue           text NOT NULL REFERENCES lockgate.queues (name),
    priority        smallint NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 9),
    max_attempts    integer NOT NULL DEFAULT 20 CHECK (max_attempts >= 1),
    backoff_base_ms bigint NOT NULL DEFAULT 1000 CHECK (backoff_base_ms >= 0),
    backoff_max_ms  bigint NOT NULL DEFAULT 3600000 CHECK (backoff_max_ms >= backoff_base_ms),
    backoff_jitter  double precision NOT NULL DEFAULT 0.1 CHECK (backoff_jitter BETWEEN 0 AND 1),
    timeout_ms      bigint CHECK (timeout_ms > 0),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- Job ids survive redelivery and dead-letter retries (a retried dead letter gets a new msg_id).
CREATE SEQUENCE lockgate.job_id_seq;

-- The dead-letter store of every queue: jobs whose last attempt failed, and messages no worker
-- could decode or whose job type does not exist. Rows leave only by an operator's retry or purge.
CREATE TABLE lockgate.dead_letters (
    id          bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY,
    queue       text NOT NULL,
    msg_id      bigint NOT NULL,
    job_id      bigint,
    job_type    text,
    args        jsonb,
    headers     jsonb,
    reason      text NOT NULL CHECK (reason IN ('attempts_exhausted', 'undecodable', 'unknown_job_type')),
    error       text,
    attempts    integer NOT NULL,
    enqueued_at timestamptz NOT NULL,
    dead_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dead_letters_queue_idx ON lockgate.dead_letters (queue, id);
CREATE INDEX dead_letters_job_id_idx ON lockgate.dead_letters (job_id);
