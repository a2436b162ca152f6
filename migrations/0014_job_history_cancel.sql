-- Job search, history and cancel (issue 12). lockgate.job and lockgate.jobs return rows of one
-- type, lockgate.job_info; the job's attempts replace its errors (sql/068_jobs.sql). The earlier
-- lookup helpers are replaced by the search's.
DROP FUNCTION IF EXISTS lockgate.job(bigint);
DROP FUNCTION IF EXISTS lockgate._job_message(text, text, bigint);
DROP FUNCTION IF EXISTS lockgate._job_fields(jsonb, jsonb, bigint, integer, timestamptz);

CREATE TYPE lockgate.job_info AS (
    id              bigint,
    state           text,
    queue           text,
    job_type        text,
    args            jsonb,
    priority        integer,
    msg_id          bigint,
    attempt         integer,
    enqueued_at     timestamptz,
    visible_at      timestamptz,
    finished_at     timestamptz,
    concurrency_key text,
    attempts        jsonb,
    reason          text,
    error           text,
    headers         jsonb
);

-- lockgate.queue_throughput counts the dead letters of the last hour per queue without reading
-- the others.
CREATE INDEX dead_letters_queue_dead_at_idx ON lockgate.dead_letters (queue, dead_at);
