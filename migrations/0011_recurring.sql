-- Recurring jobs: tasks that enqueue a job on every tick of a cron schedule, and one row per tick
-- enqueued. The tick row is what makes two schedulers enqueue a tick once (H23): it is inserted in
-- the transaction that enqueues the tick's job, under the primary key (task, tick_at), after the
-- task's row is locked (sql/100_recurring.sql).

CREATE TABLE lockgate.recurring_tasks (
    name         text PRIMARY KEY CHECK (name ~ '^[A-Za-z][A-Za-z0-9_.:-]{0,127}$'),
    cron         text NOT NULL,
    timezone     text NOT NULL DEFAULT 'UTC',
    job_type     text NOT NULL,
    args         jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(args) = 'object'),
    -- lockgate.enqueue's options for each tick's job: queue and priority only.
    options      jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(options) = 'object'),
    enabled      boolean NOT NULL DEFAULT true,
    -- 'config': owned by the [recurring] tables of lockgate.toml (removed when they no longer
    -- list it); 'sql': defined through lockgate.define_recurring (SQL, the Rust Client, the CLI).
    source       text NOT NULL DEFAULT 'sql' CHECK (source IN ('config', 'sql')),
    -- No tick at or before this instant is enqueued: set when the task is created, when its
    -- schedule changes and when it is enabled again, so none of those enqueues a past tick.
    active_since timestamptz NOT NULL DEFAULT now(),
    -- The latest tick enqueued (or whose enqueue failed), and what became of it.
    last_tick_at timestamptz,
    last_job_id  bigint,
    last_status  text,
    last_error   text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE lockgate.recurring_ticks (
    task        text NOT NULL REFERENCES lockgate.recurring_tasks (name) ON DELETE CASCADE,
    tick_at     timestamptz NOT NULL,
    -- The job enqueued (NULL when its enqueue failed), its status ('enqueued', 'parked',
    -- 'discarded' or 'failed') and the failure's message.
    job_id      bigint,
    status      text NOT NULL,
    error       text,
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task, tick_at)
);
