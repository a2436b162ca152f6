-- Job types and their policies. define_job_type is the one writer (Rust registration, the TOML
-- config and SQL users all call it); it creates the type's queue when missing.
-- Concurrency: concurrency_limit NULL means unlimited; concurrency_key lists argument paths
-- ('account.id') whose values, after the type's name, make the key; concurrency_on_conflict is
-- 'block' (park), 'discard' or 'raise' (LG004).
-- Uniqueness: unique_mode NULL means none; 'until_executed' (a lock from enqueue until the job is
-- terminal) or 'while_executing' (a lock while a run is running); unique_key lists argument paths
-- as concurrency_key does; unique_on_conflict is 'reject' (LG005) or 'discard' (status duplicate).
-- A definition identical to the stored one changes nothing and only shares the row's lock, so
-- processes that start together with the same types (a deploy) do not queue behind each
-- other's commits; a change (or a delete) of the row by another transaction still waits for the
-- definer's commit, or is waited for, so the last definition to commit is the one that holds.
-- Locks: the job_types row, FOR SHARE when the stored definition is identical (which needs the
-- UPDATE privilege), else exclusively by the upsert, and then its queue's row FOR KEY SHARE
-- (create_queue's advisory lock first, when the queue is new). A transaction that defines a type as
-- stored and later changes it can deadlock with another doing the same (both share the row,
-- neither can upgrade): a change belongs in the transaction's first definition. Callers:
-- Client::define_job_type, lockgate run, SQL users.

CREATE OR REPLACE FUNCTION lockgate.define_job_type(
    name                    text,
    queue                   text DEFAULT 'default',
    priority                integer DEFAULT 0,
    max_attempts            integer DEFAULT 20,
    backoff_base_ms         bigint DEFAULT 1000,
    backoff_max_ms          bigint DEFAULT 3600000,
    backoff_jitter          double precision DEFAULT 0.1,
    timeout_ms              bigint DEFAULT NULL,
    concurrency_limit       integer DEFAULT NULL,
    concurrency_key         text[] DEFAULT NULL,
    concurrency_duration_ms bigint DEFAULT 900000,
    concurrency_on_conflict text DEFAULT 'block',
    unique_mode             text DEFAULT NULL,
    unique_key              text[] DEFAULT NULL,
    unique_on_conflict      text DEFAULT 'reject'
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF name IS NULL OR name !~ '^[A-Za-z][A-Za-z0-9_.:-]{0,127}$' THEN
        RAISE EXCEPTION 'lockgate: invalid job type name "%"', name
            USING ERRCODE = 'LG003',
                  DETAIL = 'an ASCII letter followed by letters, digits, _, ., : or -, at most 128 characters';
    END IF;
    IF priority IS NULL OR priority NOT BETWEEN 0 AND 9 THEN
        RAISE EXCEPTION 'lockgate: invalid priority %: an integer from 0 to 9', priority USING ERRCODE = 'LG003';
    END IF;
    IF max_attempts IS NULL OR max_attempts < 1 THEN
        RAISE EXCEPTION 'lockgate: invalid max_attempts %: an integer of at least 1', max_attempts USING ERRCODE = 'LG003';
    END IF;
    IF backoff_base_ms IS NULL OR backoff_max_ms IS NULL OR backoff_jitter IS NULL
       OR backoff_base_ms < 0 OR backoff_max_ms < backoff_base_ms OR NOT backoff_jitter BETWEEN 0 AND 1 THEN
        RAISE EXCEPTION 'lockgate: invalid backoff (base % ms, max % ms, jitter %): base >= 0, max >= base, jitter from 0 to 1',
            backoff_base_ms, backoff_max_ms, backoff_jitter USING ERRCODE = 'LG003';
    END IF;
    IF timeout_ms IS NOT NULL AND timeout_ms <= 0 THEN
        RAISE EXCEPTION 'lockgate: invalid timeout_ms %: positive, or NULL for none', timeout_ms USING ERRCODE = 'LG003';
    END IF;
    -- Every duration at most 100 years (lockgate_core::MAX_DURATION): each is added to the clock
    -- somewhere (a lease's end, a retry's time), and one past PostgreSQL's timestamps failed that
    -- statement, a claim of the whole queue among them.
    IF backoff_max_ms > 3155760000000 OR timeout_ms > 3155760000000 OR concurrency_duration_ms > 3155760000000 THEN
        RAISE EXCEPTION 'lockgate: invalid % % ms: at most 3155760000000 (100 years)',
            CASE WHEN backoff_max_ms > 3155760000000 THEN 'backoff_max_ms'
                 WHEN timeout_ms > 3155760000000 THEN 'timeout_ms'
                 ELSE 'concurrency_duration_ms' END,
            GREATEST(backoff_max_ms, timeout_ms, concurrency_duration_ms) USING ERRCODE = 'LG003';
    END IF;
    IF concurrency_limit IS NOT NULL AND concurrency_limit < 1 THEN
        RAISE EXCEPTION 'lockgate: invalid concurrency limit %: an integer of at least 1', concurrency_limit
            USING ERRCODE = 'LG003';
    END IF;
    IF concurrency_duration_ms IS NULL OR concurrency_duration_ms <= 0 THEN
        RAISE EXCEPTION 'lockgate: invalid concurrency_duration_ms %: a positive number of milliseconds', concurrency_duration_ms
            USING ERRCODE = 'LG003';
    END IF;
    IF concurrency_on_conflict IS NULL OR concurrency_on_conflict NOT IN ('block', 'discard', 'raise') THEN
        RAISE EXCEPTION 'lockgate: invalid concurrency on_conflict "%": block, discard or raise', concurrency_on_conflict
            USING ERRCODE = 'LG003';
    END IF;
    IF unique_mode IS NOT NULL AND unique_mode NOT IN ('until_executed', 'while_executing') THEN
        RAISE EXCEPTION 'lockgate: invalid unique mode "%": until_executed or while_executing', unique_mode
            USING ERRCODE = 'LG003';
    END IF;
    IF unique_on_conflict IS NULL OR unique_on_conflict NOT IN ('reject', 'discard') THEN
        RAISE EXCEPTION 'lockgate: invalid unique on_conflict "%": reject or discard', unique_on_conflict
            USING ERRCODE = 'LG003';
    END IF;
    -- A key is a limit's or a mode's: given alone it did nothing, and the type ran unlimited (or
    -- not unique) where its definer meant a key (review helper-136 F13; the TOML refuses it too).
    IF concurrency_limit IS NULL AND cardinality(concurrency_key) > 0 THEN
        RAISE EXCEPTION 'lockgate: concurrency_key % without a concurrency_limit: give the limit, or no key',
            array_to_string(concurrency_key, ', ', 'NULL') USING ERRCODE = 'LG003';
    END IF;
    IF unique_mode IS NULL AND cardinality(unique_key) > 0 THEN
        RAISE EXCEPTION 'lockgate: unique_key % without a unique_mode: give until_executed or while_executing, or no key',
            array_to_string(unique_key, ', ', 'NULL') USING ERRCODE = 'LG003';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(concurrency_key || unique_key) p WHERE p IS NULL OR p !~ '^[^.]+(\.[^.]+)*$') THEN
        RAISE EXCEPTION 'lockgate: invalid key path in %: argument paths such as "account" or "account.id"',
            array_to_string(concurrency_key || unique_key, ', ', 'NULL') USING ERRCODE = 'LG003';
    END IF;
    -- Stored as given already (its queue then exists: job_types.queue references it). The share
    -- lock holds the row as it is until this transaction ends, as the upsert's lock would: a
    -- concurrent change or delete commits after this definition, or, committed first, is seen
    -- here (the row is looked at again once its writer ends) and then overwritten by the upsert.
    PERFORM FROM lockgate.job_types t
      WHERE t.name = define_job_type.name
        AND (t.queue, t.priority, t.max_attempts, t.backoff_base_ms, t.backoff_max_ms, t.backoff_jitter,
             t.timeout_ms, t.concurrency_limit, t.concurrency_key, t.concurrency_duration_ms,
             t.concurrency_on_conflict, t.unique_mode, t.unique_key, t.unique_on_conflict)
            IS NOT DISTINCT FROM
            (define_job_type.queue, define_job_type.priority, define_job_type.max_attempts,
             define_job_type.backoff_base_ms, define_job_type.backoff_max_ms, define_job_type.backoff_jitter,
             define_job_type.timeout_ms, define_job_type.concurrency_limit, define_job_type.concurrency_key,
             define_job_type.concurrency_duration_ms, define_job_type.concurrency_on_conflict,
             define_job_type.unique_mode, define_job_type.unique_key, define_job_type.unique_on_conflict)
      FOR SHARE OF t;
    IF FOUND THEN
        RETURN;
    END IF;
    PERFORM lockgate.create_queue(queue);
    -- The queue's row, FOR KEY SHARE until the commit (the foreign key takes it too, but only at
    -- the insert): a drop holding it (design §91) is waited for, and one that committed meanwhile
    -- took the queue that create_queue found, so it is created again, as it would be for a
    -- definition made a moment later, instead of failing on the key.
    PERFORM 1 FROM lockgate.queues q WHERE q.name = define_job_type.queue FOR KEY SHARE;
    IF NOT FOUND THEN
        PERFORM lockgate.create_queue(queue);
    END IF;
    INSERT INTO lockgate.job_types AS t
        (name, queue, priority, max_attempts, backoff_base_ms, backoff_max_ms, backoff_jitter, timeout_ms,
         concurrency_limit, concurrency_key, concurrency_duration_ms, concurrency_on_conflict,
         unique_mode, unique_key, unique_on_conflict)
    VALUES (define_job_type.name, define_job_type.queue, define_job_type.priority, define_job_type.max_attempts,
            define_job_type.backoff_base_ms, define_job_type.backoff_max_ms, define_job_type.backoff_jitter,
            define_job_type.timeout_ms, define_job_type.concurrency_limit, define_job_type.concurrency_key,
            define_job_type.concurrency_duration_ms, define_job_type.concurrency_on_conflict,
            define_job_type.unique_mode, define_job_type.unique_key, define_job_type.unique_on_conflict)
    ON CONFLICT ON CONSTRAINT job_types_pkey DO UPDATE SET
        queue = EXCLUDED.queue, priority = EXCLUDED.priority, max_attempts = EXCLUDED.max_attempts,
        backoff_base_ms = EXCLUDED.backoff_base_ms, backoff_max_ms = EXCLUDED.backoff_max_ms,
        backoff_jitter = EXCLUDED.backoff_jitter, timeout_ms = EXCLUDED.timeout_ms,
        concurrency_limit = EXCLUDED.concurrency_limit, concurrency_key = EXCLUDED.concurrency_key,
        concurrency_duration_ms = EXCLUDED.concurrency_duration_ms,
        concurrency_on_conflict = EXCLUDED.concurrency_on_conflict,
        unique_mode = EXCLUDED.unique_mode, unique_key = EXCLUDED.unique_key,
        unique_on_conflict = EXCLUDED.unique_on_conflict, updated_at = now(),
        -- Jobs queued or parked under another key derivation are re-keyed at their claim (H33).
        -- So are those of a lowered limit: a job that took its permit under the old limit and
        -- has not started gives it back at its claim and takes one under the new limit, or parks
        -- (review helper-79: three queued holders of a key lowered to 1 ran at once).
        concurrency_key_version = t.concurrency_key_version
            + CASE WHEN t.concurrency_key IS DISTINCT FROM EXCLUDED.concurrency_key
                     OR (t.concurrency_limit IS NULL) <> (EXCLUDED.concurrency_limit IS NULL)
                     OR EXCLUDED.concurrency_limit < t.concurrency_limit THEN 1 ELSE 0 END;
END $$;

-- The policy of one job type, or LG002 naming it.
CREATE OR REPLACE FUNCTION lockgate.job_policy(job_type text)
RETURNS lockgate.job_types LANGUAGE plpgsql STABLE AS $$
DECLARE
    jt lockgate.job_types;
BEGIN
    SELECT * INTO jt FROM lockgate.job_types t WHERE t.name = job_policy.job_type;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lockgate: unknown job type "%"', job_type
            USING ERRCODE = 'LG002', HINT = 'define it with lockgate.define_job_type or in lockgate.toml';
    END IF;
    RETURN jt;
END $$;
