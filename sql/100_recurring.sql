-- Recurring jobs: tasks that enqueue a job of a type on every tick of a cron schedule read in a
-- time zone. define_recurring stores (or replaces) a task, set_recurring_enabled and
-- remove_recurring change one, list_recurring reads them, prune_config_recurring removes the
-- config-owned tasks a configuration no longer lists, and enqueue_recurring_tick is the
-- scheduler's one write per tick.
-- The ticks themselves are computed by the scheduler (Rust, the croner crate), which also parses
-- the cron expression fully; here it is checked for its shape (5 or 6 fields, or a nickname) and
-- the time zone against PostgreSQL's list of zone names.
-- Locks: the task's row (every function that changes one); a tick then also takes what
-- lockgate.enqueue takes (a limited type's semaphore row), after the task's row.
-- Callers: Client::define_recurring and friends, lockgate run (the [recurring] sync), the
-- lockgate recurring commands, SQL users, the scheduler service of every lockgate run.

-- Raises LG003 unless cron has the shape croner parses: 5 fields, 6 with seconds first, or a
-- nickname, each field made of digits, names, * , / - ? # L W and +.
CREATE OR REPLACE FUNCTION lockgate._check_cron(task text, cron text)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    fields text[] := regexp_split_to_array(btrim(cron), '\s+');
BEGIN
    IF cron IS NULL OR length(cron) > 256
       OR NOT (btrim(cron) ~* '^@(yearly|annually|monthly|weekly|daily|hourly)$'
               OR (cardinality(fields) BETWEEN 5 AND 6
                   AND btrim(cron) ~ '^[0-9A-Za-z*,/?#+-]+(\s+[0-9A-Za-z*,/?#+-]+)*$')) THEN
        RAISE EXCEPTION 'lockgate: recurring task "%": invalid cron expression %', task, COALESCE(quote_literal(cron), 'NULL')
            USING ERRCODE = 'LG003',
                  DETAIL = '5 fields (minute hour day-of-month month day-of-week), 6 with seconds first, '
                           'or @yearly, @monthly, @weekly, @daily or @hourly';
    END IF;
END $$;

-- Stores (or replaces) a task. enabled NULL keeps a stored task's state (a new one is enabled),
-- so a definition that says nothing about it undoes no `lockgate recurring disable`. A change of
-- schedule, or enabling a disabled task, moves active_since to now: no tick from before is
-- enqueued. A definition identical to the stored one writes nothing.
-- options: {"queue": name} and {"priority": 0..9}, applied to each tick's job.
CREATE OR REPLACE FUNCTION lockgate.define_recurring(
    name     text,
    cron     text,
    job_type text,
    args     jsonb DEFAULT '{}',
    timezone text DEFAULT 'UTC',
    options  jsonb DEFAULT '{}',
    enabled  boolean DEFAULT NULL,
    source   text DEFAULT 'sql'
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    jt lockgate.job_types;
    unknown text;
BEGIN
    IF name IS NULL OR name !~ '^[A-Za-z][A-Za-z0-9_.:-]{0,127}$' THEN
        RAISE EXCEPTION 'lockgate: invalid recurring task name "%"', name
            USING ERRCODE = 'LG003',
                  DETAIL = 'an ASCII letter followed by letters, digits, _, ., : or -, at most 128 characters';
    END IF;
    PERFORM lockgate._check_cron(name, cron);
    -- pg_timezone_names reads the zone files (~0.1 s), so a stored task's zone is not looked up again.
    IF timezone IS DISTINCT FROM 'UTC'
       AND NOT EXISTS (SELECT 1 FROM lockgate.recurring_tasks t
                        WHERE t.name = define_recurring.name AND t.timezone = define_recurring.timezone)
       AND NOT EXISTS (SELECT 1 FROM pg_timezone_names z
                        WHERE z.name = define_recurring.timezone
                          AND z.name NOT LIKE 'posix/%' AND z.name NOT LIKE 'right/%'
                          -- Files of the zone database that name no zone, which the scheduler's
                          -- table (chrono-tz) does not have: a task in one never ticked (review
                          -- helper-143 F4).
                          AND z.name NOT IN ('localtime', 'posixrules', 'Factory')) THEN
        RAISE EXCEPTION 'lockgate: recurring task "%": unknown time zone "%"', name, timezone
            USING ERRCODE = 'LG003', DETAIL = 'an IANA time zone name such as Europe/Berlin or UTC';
    END IF;
    -- The type's row and the queue's are held FOR KEY SHARE until the commit: a removal of the type
    -- or a drop of the queue, which lock them before counting the tasks that name them, either
    -- counts this task or has committed before it looks (design §91).
    SELECT * INTO jt FROM lockgate.job_types t WHERE t.name = define_recurring.job_type FOR KEY SHARE;
    IF NOT FOUND THEN
        -- Looked for again by a new statement: a row deleted and made again while this waited for
        -- it (a removal and a definition in one transaction) is another row, which the wait does
        -- not follow (review helper-96).
        SELECT * INTO jt FROM lockgate.job_types t WHERE t.name = define_recurring.job_type FOR KEY SHARE;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lockgate: recurring task "%": unknown job type "%"', name, job_type
            USING ERRCODE = 'LG002', HINT = 'define it with lockgate.define_job_type or in lockgate.toml';
    END IF;
    IF args IS NULL OR jsonb_typeof(args) <> 'object' THEN
        RAISE EXCEPTION 'lockgate: recurring task "%": job arguments must be a JSON object, got %', name, COALESCE(jsonb_typeof(args), 'null')
            USING ERRCODE = 'LG003';
    END IF;
    PERFORM lockgate._check_args(args);
    options := COALESCE(options, '{}');
    IF jsonb_typeof(options) <> 'object' THEN
        RAISE EXCEPTION 'lockgate: recurring task "%": options must be a JSON object', name USING ERRCODE = 'LG003';
    END IF;
    SELECT string_agg(k, ', ') INTO unknown FROM jsonb_object_keys(options) k WHERE k NOT IN ('queue', 'priority');
    IF unknown IS NOT NULL THEN
        RAISE EXCEPTION 'lockgate: recurring task "%": unknown option(s): %', name, unknown
            USING ERRCODE = 'LG003', DETAIL = 'allowed: queue, priority';
    END IF;
    PERFORM lockgate._resolve_options(jt, options);  -- a bad priority raises LG003
    IF options ? 'queue' THEN
        PERFORM lockgate._queue_table(options->>'queue', 'q');  -- an unknown queue raises LG001
        PERFORM 1 FROM lockgate.queues q WHERE q.name = options->>'queue' FOR KEY SHARE;
        IF NOT FOUND THEN
            -- As for the type: a queue dropped and made again in one transaction is another row.
            PERFORM 1 FROM lockgate.queues q WHERE q.name = options->>'queue' FOR KEY SHARE;
        END IF;
        IF NOT FOUND THEN
            -- Dropped while this waited for its row.
            RAISE EXCEPTION 'lockgate: recurring task "%": unknown queue "%"', name, options->>'queue'
                USING ERRCODE = 'LG001', HINT = 'create it with lockgate.create_queue or lockgate queue create';
        END IF;
    END IF;
    IF source IS NULL OR source NOT IN ('config', 'sql') THEN
        RAISE EXCEPTION 'lockgate: invalid recurring task source "%": config or sql', source USING ERRCODE = 'LG003';
    END IF;
    -- A task belongs to the configuration or to SQL users, and one never takes over the other's:
    -- a configuration that no longer lists a task deletes it, which must never happen to a task
    -- defined through SQL, the client or the CLI.
    IF EXISTS (SELECT 1 FROM lockgate.recurring_tasks t
                WHERE t.name = define_recurring.name AND t.source <> define_recurring.source) THEN
        RAISE EXCEPTION 'lockgate: recurring task "%" is already defined %', name,
            CASE WHEN source = 'config' THEN 'through SQL, the client or the CLI: remove it (lockgate recurring remove '
                                             || name || ') or give the configuration''s task another name'
                 ELSE 'by a lockgate.toml [recurring] table: change it there, or choose another name' END
            USING ERRCODE = 'LG003',
                  HINT = CASE WHEN source = 'config' THEN 'remove it (lockgate recurring remove) or give the configuration''s task another name'
                              ELSE 'change it in the configuration, or choose another name' END;
    END IF;
    INSERT INTO lockgate.recurring_tasks AS t (name, cron, timezone, job_type, args, options, enabled, source, active_since)
    VALUES (define_recurring.name, define_recurring.cron, define_recurring.timezone, define_recurring.job_type,
            define_recurring.args, define_recurring.options, COALESCE(define_recurring.enabled, true),
            define_recurring.source, clock_timestamp())
    ON CONFLICT ON CONSTRAINT recurring_tasks_pkey DO UPDATE SET
        cron = EXCLUDED.cron, timezone = EXCLUDED.timezone, job_type = EXCLUDED.job_type, args = EXCLUDED.args,
        options = EXCLUDED.options, source = EXCLUDED.source,
        enabled = COALESCE(define_recurring.enabled, t.enabled),
        active_since = CASE WHEN t.cron <> EXCLUDED.cron OR t.timezone <> EXCLUDED.timezone
                                 OR (NOT t.enabled AND COALESCE(define_recurring.enabled, false)) THEN clock_timestamp()
                            ELSE t.active_since END,
        updated_at = now()
    WHERE (t.cron, t.timezone, t.job_type, t.args, t.options, t.source, t.enabled)
          IS DISTINCT FROM (EXCLUDED.cron, EXCLUDED.timezone, EXCLUDED.job_type, EXCLUDED.args, EXCLUDED.options,
                            EXCLUDED.source, COALESCE(define_recurring.enabled, t.enabled));
END $$;

-- Enables or disables a task; LG006 names an unknown one. Enabling a disabled task moves
-- active_since to now, so the ticks it missed while disabled are not enqueued.
CREATE OR REPLACE FUNCTION lockgate.set_recurring_enabled(name text, enabled boolean)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF enabled IS NULL THEN
        RAISE EXCEPTION 'lockgate: enabled must be true or false' USING ERRCODE = 'LG003';
    END IF;
    UPDATE lockgate.recurring_tasks t
       SET enabled = set_recurring_enabled.enabled,
           active_since = CASE WHEN NOT t.enabled AND set_recurring_enabled.enabled THEN clock_timestamp() ELSE t.active_since END,
           updated_at = now()
     WHERE t.name = set_recurring_enabled.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lockgate: unknown recurring task "%"', name
            USING ERRCODE = 'LG006', HINT = 'lockgate.list_recurring() and `lockgate recurring list` show the defined tasks';
    END IF;
END $$;

-- Deletes a task and its ticks; false if there was none.
CREATE OR REPLACE FUNCTION lockgate.remove_recurring(name text)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM lockgate.recurring_tasks t WHERE t.name = remove_recurring.name;
    RETURN FOUND;
END $$;

-- Every task, by name.
CREATE OR REPLACE FUNCTION lockgate.list_recurring()
RETURNS SETOF lockgate.recurring_tasks LANGUAGE sql STABLE AS $$
    SELECT * FROM lockgate.recurring_tasks ORDER BY name
$$;

-- Removes the config-owned tasks that are not in keep (the names a configuration lists) and
-- returns their names. Tasks defined through SQL are never touched.
CREATE OR REPLACE FUNCTION lockgate.prune_config_recurring(keep text[])
RETURNS SETOF text LANGUAGE sql AS $$
    DELETE FROM lockgate.recurring_tasks t
     WHERE t.source = 'config' AND NOT (t.name = ANY (COALESCE(keep, '{}')))
    RETURNING t.name
$$;

-- Enqueues the job of one tick of a task, once however many schedulers call it (H23): the tick
-- row is inserted, under the primary key (task, tick_at), in the same transaction as the
-- enqueue, after the task's row is locked. The row is never waited for: another transaction
-- holding it (a scheduler racing this one on the tick, which enqueues it; a definition, enable or
-- removal not yet committed) makes the tick 'busy', for the caller's next pass to look at again.
-- Waiting, every pass of every scheduler waited for a held task, holding up every other task's
-- ticks (up to 5 s per pass: review helper-134 F1). A stale scheduler never enqueues a tick at or
-- before the latest one enqueued (so a downtime's ticks stay collapsed into one).
-- status: the enqueue's ('enqueued', 'parked' or 'discarded'), 'failed' (the enqueue raised one
-- of lockgate's own errors, SQLSTATE class LG: recorded with the message and not retried, so a
-- bad task cannot make every pass fail), 'taken' (this tick or a later one was enqueued already),
-- 'busy' (the task's row is held: nothing written) or 'inactive' (the task is disabled, removed,
-- or the tick is from before it was active).
-- Ticks older than 7 days before the new one are deleted: the tick rows are history; the
-- guard against a repeat is the task's last_tick_at.
-- schedule_cron and schedule_timezone: the schedule the caller computed the tick from, as it
-- read the task (the scheduler passes them). A definition that changed the schedule and
-- committed while this call waited for the task's row set active_since before its commit, so
-- a tick of the old schedule can come after it; the schedule compared under the row lock makes
-- it 'inactive' all the same. NULL (the two-argument form): not compared.
-- A key the tick's job needs that a producer holds (a limited type's semaphore row) makes the
-- tick give up after 500 ms (lock_timeout, set for this call only) and try again on the next
-- pass, instead of holding up the rest.
-- Locks: the task's row (SKIP LOCKED), the tick row, then what lockgate.enqueue locks.
CREATE OR REPLACE FUNCTION lockgate.enqueue_recurring_tick(
    task text, tick_at timestamptz, schedule_cron text, schedule_timezone text,
    OUT status text, OUT job_id bigint, OUT error text
) LANGUAGE plpgsql SET lock_timeout = '500ms' AS $$
DECLARE
    t lockgate.recurring_tasks;
    e record;
BEGIN
    IF tick_at IS NULL OR tick_at > clock_timestamp() THEN
        RAISE EXCEPTION 'lockgate: recurring task "%": tick % is in the future', task, tick_at USING ERRCODE = 'LG003';
    END IF;
    SELECT * INTO t FROM lockgate.recurring_tasks r WHERE r.name = enqueue_recurring_tick.task
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND AND EXISTS (SELECT 1 FROM lockgate.recurring_tasks r WHERE r.name = enqueue_recurring_tick.task) THEN
        status := 'busy';
        RETURN;
    END IF;
    IF NOT FOUND OR NOT t.enabled OR tick_at <= t.active_since
       OR (schedule_cron IS NOT NULL AND t.cron IS DISTINCT FROM schedule_cron)
       OR (schedule_timezone IS NOT NULL AND t.timezone IS DISTINCT FROM schedule_timezone) THEN
        status := 'inactive';
        RETURN;
    END IF;
    IF tick_at <= t.last_tick_at THEN
        status := 'taken';
        RETURN;
    END IF;
    INSERT INTO lockgate.recurring_ticks (task, tick_at, status)
    VALUES (enqueue_recurring_tick.task, enqueue_recurring_tick.tick_at, 'enqueued')
    ON CONFLICT ON CONSTRAINT recurring_ticks_pkey DO NOTHING;
    IF NOT FOUND THEN
        status := 'taken';
        RETURN;
    END IF;
    BEGIN
        SELECT q.job_id, q.status INTO e FROM lockgate.enqueue(t.job_type, t.args, t.options) q;
        job_id := e.job_id;
        status := e.status;
    EXCEPTION WHEN OTHERS THEN
        -- A passing condition (a lock not had in time, a lost connection, a cancelled or
        -- conflicting statement) aborts the tick, which the next pass tries again; any other
        -- error (lockgate's own, a queue table dropped outside lockgate, ...) is the tick's
        -- outcome: recorded as failed, and the task's next tick comes as usual.
        IF SQLSTATE IN ('55P03', '57014', '40001', '40P01') OR left(SQLSTATE, 2) IN ('08', '57', '53') THEN
            RAISE;
        END IF;
        status := 'failed';
        error := SQLERRM;
    END;
    UPDATE lockgate.recurring_ticks k
       SET job_id = enqueue_recurring_tick.job_id, status = enqueue_recurring_tick.status,
           error = enqueue_recurring_tick.error
     WHERE k.task = enqueue_recurring_tick.task AND k.tick_at = enqueue_recurring_tick.tick_at;
    UPDATE lockgate.recurring_tasks r
       SET last_tick_at = enqueue_recurring_tick.tick_at, last_job_id = enqueue_recurring_tick.job_id,
           last_status = enqueue_recurring_tick.status, last_error = enqueue_recurring_tick.error
     WHERE r.name = enqueue_recurring_tick.task;
    DELETE FROM lockgate.recurring_ticks k
     WHERE k.task = enqueue_recurring_tick.task AND k.tick_at < enqueue_recurring_tick.tick_at - interval '7 days';
END $$;

-- The form of revisions before 49, which compares no schedule: kept under its signature so that
-- its grants and the calls of older processes stay as they were.
CREATE OR REPLACE FUNCTION lockgate.enqueue_recurring_tick(
    task text, tick_at timestamptz, OUT status text, OUT job_id bigint, OUT error text
) LANGUAGE sql AS $$
    SELECT * FROM lockgate.enqueue_recurring_tick(task, tick_at, NULL, NULL)
$$;
