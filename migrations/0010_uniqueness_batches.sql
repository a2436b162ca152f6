-- Uniqueness and batches (G2, H14, H22): lock rows owned by one job, and batch counters, both
-- changed only in the transactions whose fenced statement decided the job's fate. See
-- sql/016_uniqueness.sql and sql/017_batches.sql for the functions that use them.

-- Functions whose signatures change in this version; sql/ recreates them.
DROP FUNCTION IF EXISTS lockgate.define_job_type(text, text, integer, integer, bigint, bigint, double precision, bigint,
                                                 integer, text[], bigint, text);
DROP FUNCTION IF EXISTS lockgate.dlq_retry(text, bigint[]);
DROP FUNCTION IF EXISTS lockgate._enqueue_one(lockgate.job_types, jsonb, text, smallint, timestamptz, boolean, text);
DROP FUNCTION IF EXISTS lockgate._resolve_options(lockgate.job_types, jsonb);

-- A job type's uniqueness: at most one job per key holds its lock. until_executed takes the
-- lock at enqueue and holds it until the job is terminal; while_executing takes it when a run
-- starts and gives it back when the run ends. unique_key lists argument paths, as
-- concurrency_key does; unique_on_conflict is 'reject' (LG005) or 'discard' (status duplicate).
ALTER TABLE lockgate.job_types
    ADD COLUMN unique_mode text CHECK (unique_mode IN ('until_executed', 'while_executing')),
    ADD COLUMN unique_key text[],
    ADD COLUMN unique_on_conflict text NOT NULL DEFAULT 'reject'
        CHECK (unique_on_conflict IN ('reject', 'discard'));

-- One row per held uniqueness key, owned by one job: (queue, job_id), the job's id being the
-- msg_id of its first message. msg_id is the job's current message (NULL while it is parked),
-- kept up to date where a job moves to a new message (promotion, parking at claim), and read
-- only by the reaper to tell whether the job still exists.
CREATE TABLE lockgate.unique_locks (
    key         text PRIMARY KEY,
    mode        text NOT NULL CHECK (mode IN ('until_executed', 'while_executing')),
    job_type    text NOT NULL,
    queue       text NOT NULL,
    job_id      bigint NOT NULL,
    msg_id      bigint,
    acquired_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX unique_locks_owner_idx ON lockgate.unique_locks (queue, job_id);

-- Parked jobs are found by id (the reaper, an owner's release when it is discarded).
CREATE INDEX parked_job_id_idx ON lockgate.parked (job_id);

-- A batch: jobs enqueued into it in one or several calls, counted as they finish. open accepts
-- jobs; closed accepts none and finishes when its last job is counted; finished is final.
-- total, succeeded and failed are exact at every commit: total grows in the enqueue
-- transaction, succeeded and failed in the completion and dead-letter transactions, gated by
-- the fenced statement, so a duplicate delivery or a retry counts once. Callbacks are job types
-- enqueued, in the transaction that finishes the batch, with the batch's counts and properties;
-- callbacks_pending marks a finish whose callbacks could not be enqueued (its type was removed):
-- the sweep retries them.
CREATE TABLE lockgate.batches (
    id                bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY,
    state             text NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'closed', 'finished')),
    total             bigint NOT NULL DEFAULT 0 CHECK (total >= 0),
    succeeded         bigint NOT NULL DEFAULT 0 CHECK (succeeded >= 0),
    failed            bigint NOT NULL DEFAULT 0 CHECK (failed >= 0),
    on_finish         text,
    on_success        text,
    on_failure        text,
    properties        jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(properties) = 'object'),
    callbacks_pending boolean NOT NULL DEFAULT false,
    callback_error    text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    closed_at         timestamptz,
    finished_at       timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT batches_counted_within_total CHECK (succeeded + failed <= total)
);
CREATE INDEX batches_unfinished_idx ON lockgate.batches (updated_at) WHERE state <> 'finished' OR callbacks_pending;

-- The jobs of a batch not counted yet: inserted with the job in the enqueue transaction (as
-- total grows), deleted in the transaction that counts it. Membership is the job's, (queue,
-- job_id), so only a job that was added to a batch is ever counted, once; a job deleted outside
-- lockgate leaves its row, which the batch reaper finds.
CREATE TABLE lockgate.batch_jobs (
    queue    text NOT NULL,
    job_id   bigint NOT NULL,
    batch_id bigint NOT NULL REFERENCES lockgate.batches (id),
    PRIMARY KEY (queue, job_id)
);
CREATE INDEX batch_jobs_batch_idx ON lockgate.batch_jobs (batch_id);
