-- Enqueue: one job (lockgate.enqueue) or many jobs of one type (lockgate.enqueue_many), in the
-- caller's transaction (G8): the job exists if and only if that transaction commits.
-- Arguments are a JSON object (the PGMQ message); lockgate's fields go in the PGMQ headers.
-- options: {"delay": seconds >= 0} or {"run_at": timestamptz}, {"priority": 0..9}, {"queue": name},
-- {"concurrency_key": text} (only for types with a concurrency limit), {"unique_key": text} (only
-- for types with uniqueness), {"batch": id} (an open batch, lockgate.create_batch).
-- Each row returned has a status: 'enqueued' (a message exists, msg_id set), 'parked' (its key
-- is full and on_conflict is block: it waits in lockgate.parked), 'discarded' (full, discard) or
-- 'duplicate' (its unique key is held and its type discards duplicates: job_id names the job
-- holding the key). A full key with on_conflict raise fails with LG004, a held unique key with
-- on_conflict reject with LG005. The uniqueness lock, acquire-or-park, the send and the batch
-- membership are one transaction, so no crash window needs repairing (H11).
-- Locks, in this order: the batch row FOR KEY SHARE (a job added to a batch: it never updates
-- the row, so it waits for nothing but a close_batch), the unique lock row (types with
-- until_executed uniqueness), the key's semaphore row (limited types), inserts into
-- pgmq.q_<queue> and lockgate.batch_jobs.
-- Wake-ups: a job that can run now notifies the queue's channel (lockgate_<queue>) in the same
-- transaction, so an idle worker claims it as soon as it commits. PostgreSQL serialises every
-- commit that notified on one lock, held while the commit is flushed, so concurrent producers
-- queue behind each other's flushes. The four-argument forms take notify: false sends nothing,
-- for a caller that wakes the workers after its commit with lockgate.wake, in a transaction of
-- its own that has no flush to wait for. The Rust Client does (docs/design.md section 50).
-- Privileges (docs/design.md section 83): the four-argument forms, _enqueue_many_and_wake,
-- create_batch and close_batch are SECURITY DEFINER with a fixed search_path and executable only
-- by the roles granted them (README, "A producer's role"): they write the permit, lease, unique
-- lock, batch and queue tables as the role that ran lockgate migrate, so a producer's role needs
-- no write grant on any of them, and cannot change permits by hand. What the caller chooses
-- stays the caller's: its transaction, isolation level and lock settings (only search_path is
-- fixed, for the call). The other functions that run as lockgate's owner for any caller do only
-- what a migrate or the sweep does (the step installers, _give_back_finished); the
-- three-argument forms run as their caller, so they need the grant of the form they call.
-- Callers: the Rust Client, the CLI, SQL producers, triggers.

-- The INSERT of an enqueue into the queue table tbl, with ($1 vt, $2 args, $3 headers),
-- its msg_ids drawn from lockgate.job_id_seq by name, not left to the column's default (which is
-- that sequence): a table made again behind lockgate's back (pgmq.create, whose msg_id is an
-- identity column numbering from 1) refuses them, where a default would give jobs the ids of
-- other jobs until lockgate adopts the table again (create_queue; check_invariants names it),
-- returning the msg_ids in the order of args: one job (args jsonb) when one, else many (args
-- jsonb[]; only those that are JSON objects of at most 1 MiB, the caller raising for the first
-- other one). The body of the queue's enqueue steps, and the statement an enqueue plans itself
-- when it cannot trust them.
CREATE OR REPLACE FUNCTION lockgate._enqueue_sql(tbl text, one boolean)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN one THEN format('INSERT INTO %s (msg_id, vt, message, headers)
            VALUES (nextval(''lockgate.job_id_seq''), $1, $2, $3) RETURNING msg_id', tbl)
                ELSE format('INSERT INTO %s (msg_id, vt, message, headers)
            SELECT nextval(''lockgate.job_id_seq''), $1, a.v, $3
              FROM unnest($2) a(v)
             WHERE jsonb_typeof(a.v) = ''object'' AND pg_column_size(a.v) <= 1048576
            RETURNING msg_id', tbl) END
$$;

-- A queue's enqueue steps, generated with its table's name written in, as the claim step is
-- (sql/020_claim.sql). lockgate._enqueue_into_<queue>(vt, args, headers) inserts one message
-- per element of args that is a JSON object of at most 1 MiB, in the order of args, all visible
-- at vt with the same headers, and returns their msg_ids in that order;
-- lockgate._enqueue1_into_<queue>(vt, args, headers) inserts the one message of a single
-- enqueue (arguments already checked) and returns its msg_id, without an array or a set to pass
-- it through. An INSERT on a table named at run time is planned at every call, and planning it
-- cost about as much as inserting fifty jobs; in a function of its own, PL/pgSQL plans it once
-- per session, and the caller's dynamic statement is only the step's call. Written through
-- lockgate._write_step by create_queue and, for every queue, each time the functions are
-- installed (the end of this file); never inside a producer's transaction (an enqueue that
-- finds no step it can trust plans its INSERT instead, lockgate._enqueue_step). SECURITY
-- DEFINER for the reason the claim step's installer is; every argument of its calls is typed,
-- so no overload another role might add under a called function's name can be a better match
-- and run as the installer. Locks: none when nothing changes; else the queue name's advisory
-- lock, then catalog rows. Callers: create_queue, migrate.
CREATE OR REPLACE FUNCTION lockgate._install_enqueue_steps(queue text)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET client_min_messages = warning AS $$
DECLARE
    tbl text := lockgate._queue_table(queue, 'q'::text);
BEGIN
    PERFORM lockgate._write_step(queue, '_enqueue_into_'::text,
        'SETOF bigint'::text, NULL::text[],
        format(E'\n        BEGIN\n            RETURN QUERY %s;\n        END ', lockgate._enqueue_sql(tbl, false)),
        '{}'::text[]);
    PERFORM lockgate._write_step(queue, '_enqueue1_into_'::text,
        'bigint'::text, NULL::text[],
        format(E'\n        DECLARE\n            id bigint;\n        BEGIN\n            %s INTO id;\n            RETURN id;\n        END ',
               lockgate._enqueue_sql(tbl, true)),
        '{}'::text[]);
END $$;

-- The statement that inserts an enqueue's messages into queue's table (lockgate._enqueue_sql's
-- parameters and result): the call of the queue's enqueue step when lockgate._trusted_step
-- trusts it, else the INSERT itself, planned at this call as before the steps existed. So an
-- enqueue never runs another role's code, never fails for a step (dropped by hand, planted or
-- overloaded by another role, its EXECUTE revoked), and takes no lock and writes no catalog row
-- in the producer's transaction; `lockgate doctor` names such a step (queue_steps) and the next
-- migrate writes the steps again. LG001 for an unknown queue.
CREATE OR REPLACE FUNCTION lockgate._enqueue_step(queue text, one boolean)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    prefix text := CASE WHEN one THEN '_enqueue1_into_' ELSE '_enqueue_into_' END;
    step text := prefix || queue;
BEGIN
    IF lockgate._trusted_step(prefix, queue) THEN
        RETURN CASE WHEN one THEN format('SELECT lockgate.%I($1, $2, $3)', step)
                    ELSE format('SELECT s.id FROM lockgate.%I($1, $2, $3) s(id)', step) END;
    END IF;
    RETURN lockgate._enqueue_sql(lockgate._queue_table(queue, 'q'), one);
END $$;

-- Refuses anything that is not a JSON object of at most 1 MiB (MAX_PAYLOAD_BYTES in Rust).
CREATE OR REPLACE FUNCTION lockgate._check_args(args jsonb, ordinal integer DEFAULT NULL)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    which text := CASE WHEN ordinal IS NULL THEN '' ELSE ' #' || ordinal END;
BEGIN
    IF args IS NULL OR jsonb_typeof(args) <> 'object' THEN
        RAISE EXCEPTION 'lockgate: job arguments% must be a JSON object, got %', which, COALESCE(jsonb_typeof(args), 'null')
            USING ERRCODE = 'LG003';
    END IF;
    IF pg_column_size(args) > 1048576 THEN
        RAISE EXCEPTION 'lockgate: job arguments% are % bytes, more than the 1048576 allowed', which, pg_column_size(args)
            USING ERRCODE = 'LG003';
    END IF;
END $$;

-- Raises for the first element of args that _check_args refuses, naming its position.
CREATE OR REPLACE FUNCTION lockgate._check_all_args(args jsonb[])
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    bad record;
BEGIN
    SELECT a.v, a.i INTO bad FROM unnest(args) WITH ORDINALITY a(v, i)
     WHERE a.v IS NULL OR jsonb_typeof(a.v) <> 'object' OR pg_column_size(a.v) > 1048576
     LIMIT 1;
    IF FOUND THEN
        PERFORM lockgate._check_args(bad.v, bad.i::integer);
    END IF;
END $$;

-- Raises for the first element of args whose derived concurrency or unique key is longer than
-- 512 characters, naming its position (the single-job paths, lockgate._enqueue_one and
-- lockgate._unique_key, raise the same without it). Keys given in the options were checked with
-- them. Caller: lockgate._enqueue_each, before it takes any key.
CREATE OR REPLACE FUNCTION lockgate._check_derived_keys(jt lockgate.job_types, args jsonb[], explicit_ckey text,
    explicit_ukey text)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    IF jt.concurrency_limit IS NOT NULL AND explicit_ckey IS NULL AND cardinality(jt.concurrency_key) > 0 THEN
        SELECT a.i, length(lockgate._concurrency_key(jt, a.v, NULL)) AS n INTO bad
          FROM unnest(args) WITH ORDINALITY a(v, i)
         WHERE length(lockgate._concurrency_key(jt, a.v, NULL)) > 512
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'lockgate: the concurrency key derived from job arguments #% is % characters, more than the 512 allowed', bad.i, bad.n
                USING ERRCODE = 'LG003', DETAIL = format('key paths %s of job type "%s"', jt.concurrency_key, jt.name);
        END IF;
    END IF;
    IF jt.unique_mode IS NOT NULL AND explicit_ukey IS NULL AND cardinality(jt.unique_key) > 0 THEN
        SELECT a.i, length(lockgate._key_of(jt.name, jt.unique_key, a.v, NULL)) AS n INTO bad
          FROM unnest(args) WITH ORDINALITY a(v, i)
         WHERE length(lockgate._key_of(jt.name, jt.unique_key, a.v, NULL)) > 512
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'lockgate: the unique key derived from job arguments #% is % characters, more than the 512 allowed', bad.i, bad.n
                USING ERRCODE = 'LG003', DETAIL = format('key paths %s of job type "%s"', jt.unique_key, jt.name);
        END IF;
    END IF;
END $$;

-- Resolves the options object against the job type's policy: target queue, priority, visible-at,
-- and an explicit concurrency key.
CREATE OR REPLACE FUNCTION lockgate._resolve_options(
    jt lockgate.job_types, options jsonb,
    OUT queue text, OUT priority smallint, OUT vt timestamptz, OUT immediate boolean, OUT ckey text,
    OUT ukey text, OUT batch bigint
) LANGUAGE plpgsql STABLE AS $$
DECLARE
    unknown text;
    delay_s double precision;
BEGIN
    options := COALESCE(options, '{}');
    queue := jt.queue;
    priority := jt.priority;
    vt := clock_timestamp();
    immediate := true;
    IF options = '{}' THEN
        RETURN;  -- the common case: the type's policy as it is
    END IF;
    IF jsonb_typeof(options) <> 'object' THEN
        RAISE EXCEPTION 'lockgate: enqueue options must be a JSON object' USING ERRCODE = 'LG003';
    END IF;
    SELECT string_agg(k, ', ') INTO unknown FROM jsonb_object_keys(options) k
     WHERE k NOT IN ('delay', 'run_at', 'priority', 'queue', 'concurrency_key', 'unique_key', 'batch');
    IF unknown IS NOT NULL THEN
        RAISE EXCEPTION 'lockgate: unknown enqueue option(s): %', unknown
            USING ERRCODE = 'LG003', DETAIL = 'allowed: delay, run_at, priority, queue, concurrency_key, unique_key, batch';
    END IF;
    IF options ? 'delay' AND options ? 'run_at' THEN
        RAISE EXCEPTION 'lockgate: give delay or run_at, not both' USING ERRCODE = 'LG003';
    END IF;
    IF options ? 'delay' THEN
        -- Compared as numeric, which holds any JSON number (1e400 overflows a double); at most
        -- 100 years, as every duration lockgate stores (lockgate_core::MAX_DURATION), so that the
        -- job's time stays one PostgreSQL, and every client reading it, can hold.
        IF jsonb_typeof(options->'delay') <> 'number'
           OR NOT (options->'delay')::numeric BETWEEN 0 AND 3155760000 THEN
            RAISE EXCEPTION 'lockgate: invalid delay %: a number of seconds from 0 to 3155760000 (100 years)', options->'delay'
                USING ERRCODE = 'LG003';
        END IF;
        delay_s := (options->>'delay')::double precision;
        vt := vt + make_interval(secs => delay_s);
        immediate := delay_s = 0;
    ELSIF options ? 'run_at' THEN
        IF jsonb_typeof(options->'run_at') <> 'string'
           OR (options->>'run_at') !~ '^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}(:?\d{2})?)?$' THEN
            RAISE EXCEPTION 'lockgate: invalid run_at %: an ISO 8601 timestamp', options->'run_at'
                USING ERRCODE = 'LG003';
        END IF;
        -- The pattern admits what no calendar holds ("2030-13-45T99:99"): named here, not a
        -- bare 22008. Its four-digit year keeps it within what every client can read.
        BEGIN
            vt := GREATEST((options->>'run_at')::timestamptz, vt);
        EXCEPTION WHEN datetime_field_overflow OR invalid_datetime_format THEN
            RAISE EXCEPTION 'lockgate: invalid run_at %: not a date and time (%)', options->'run_at', SQLERRM
                USING ERRCODE = 'LG003';
        END;
        immediate := vt <= clock_timestamp();
    END IF;
    IF options ? 'priority' THEN
        IF jsonb_typeof(options->'priority') <> 'number' OR (options->>'priority') !~ '^[0-9]$' THEN
            RAISE EXCEPTION 'lockgate: invalid priority %: an integer from 0 to 9', options->'priority'
                USING ERRCODE = 'LG003';
        END IF;
        priority := (options->>'priority')::smallint;
    END IF;
    IF options->>'queue' IS NOT NULL THEN
        IF jsonb_typeof(options->'queue') <> 'string' THEN
            RAISE EXCEPTION 'lockgate: invalid queue %: a queue name, as a string', options->'queue'
                USING ERRCODE = 'LG003';
        END IF;
        -- LG001 names an unknown queue here, before a job is parked for it or its enqueue step
        -- looked up (a type's own queue exists: job_types.queue references lockgate.queues).
        queue := options->>'queue';
        PERFORM lockgate._queue_table(queue, 'q');
    END IF;
    IF options ? 'concurrency_key' THEN
        IF jt.concurrency_limit IS NULL THEN
            RAISE EXCEPTION 'lockgate: job type "%" has no concurrency limit, so it takes no concurrency_key', jt.name
                USING ERRCODE = 'LG003';
        END IF;
        IF jsonb_typeof(options->'concurrency_key') <> 'string' OR length(options->>'concurrency_key') NOT BETWEEN 1 AND 512 THEN
            RAISE EXCEPTION 'lockgate: invalid concurrency_key %: a string of 1 to 512 characters', options->'concurrency_key'
                USING ERRCODE = 'LG003';
        END IF;
        ckey := options->>'concurrency_key';
    END IF;
    IF options ? 'unique_key' THEN
        IF jt.unique_mode IS NULL THEN
            RAISE EXCEPTION 'lockgate: job type "%" has no uniqueness, so it takes no unique_key', jt.name
                USING ERRCODE = 'LG003';
        END IF;
        IF jsonb_typeof(options->'unique_key') <> 'string' OR length(options->>'unique_key') NOT BETWEEN 1 AND 512 THEN
            RAISE EXCEPTION 'lockgate: invalid unique_key %: a string of 1 to 512 characters', options->'unique_key'
                USING ERRCODE = 'LG003';
        END IF;
        ukey := options->>'unique_key';
    END IF;
    IF options ? 'batch' THEN
        IF jsonb_typeof(options->'batch') <> 'number' OR (options->>'batch') !~ '^[1-9][0-9]{0,17}$' THEN
            RAISE EXCEPTION 'lockgate: invalid batch %: the id lockgate.create_batch returned', options->'batch'
                USING ERRCODE = 'LG003';
        END IF;
        batch := (options->>'batch')::bigint;
    END IF;
END $$;

-- The headers of a freshly enqueued job: its type, and its priority unless it is 0 (the claim
-- reads a missing priority as 0). No job id: a job's id is the msg_id of its first message, and
-- only a job sent again as a new message (promoted, retried from the dead letters) carries its
-- id in the headers' job_id. STABLE, as jsonb_build_object is: declared IMMUTABLE, PostgreSQL
-- would not inline it into its callers' expressions, and ran it as a SQL function planned again
-- in every transaction (28 of a single enqueue's 114 us of server time).
CREATE OR REPLACE FUNCTION lockgate._headers(job_type text, priority smallint)
RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN priority = 0 THEN jsonb_build_object('type', job_type)
                ELSE jsonb_build_object('type', job_type, 'priority', priority) END
$$;

-- The unique key of a job of type jt with arguments args (explicit_ukey when given), checked
-- for length. Callers: lockgate._enqueue_one, lockgate._enqueue_each.
CREATE OR REPLACE FUNCTION lockgate._unique_key(jt lockgate.job_types, args jsonb, explicit_ukey text)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    ukey text := lockgate._key_of(jt.name, jt.unique_key, args, explicit_ukey);
BEGIN
    IF length(ukey) > 512 THEN
        RAISE EXCEPTION 'lockgate: the unique key derived from the arguments is % characters, more than the 512 allowed', length(ukey)
            USING ERRCODE = 'LG003', DETAIL = format('key paths %s of job type "%s"', jt.unique_key, jt.name);
    END IF;
    RETURN ukey;
END $$;

-- Takes unique key ukey (type jt, until_executed) for a new job of queue: returns the new job's
-- id, and the holder's id when another job holds the key. Waits for a transaction that took the
-- key and has not committed. Callers: lockgate._enqueue_one, lockgate._enqueue_each.
CREATE OR REPLACE FUNCTION lockgate._take_until_executed(jt lockgate.job_types, ukey text, queue text,
    OUT job_id bigint, OUT holder bigint)
LANGUAGE plpgsql AS $$
BEGIN
    job_id := nextval('lockgate.job_id_seq');
    holder := lockgate._take_unique(ukey, 'until_executed', jt.name, queue, job_id, job_id);
END $$;

-- A job of type jt found unique key ukey held by job holder: raises LG005 when the type rejects
-- duplicates, else returns holder, the id a duplicate reports. Callers: lockgate._enqueue_one,
-- lockgate._enqueue_each.
CREATE OR REPLACE FUNCTION lockgate._duplicate_of(jt lockgate.job_types, ukey text, holder bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN
    IF jt.unique_on_conflict = 'reject' THEN
        RAISE EXCEPTION 'lockgate: unique key "%" of job type "%" is held by job %', ukey, jt.name, holder
            USING ERRCODE = 'LG005',
                  DETAIL = (CASE WHEN EXISTS (SELECT 1 FROM lockgate.unique_locks u
                                               WHERE u.key = ukey AND u.mode = 'while_executing')
                                 THEN 'that job is running with the key (its type is unique while executing): the key is free again once the run ends, or once the run has lapsed (its worker stopped renewing it past its visibility) and the next sweep or a claim of the key gives it back'
                                 ELSE 'the key is free again once that job succeeds, is dead-lettered or is discarded' END);
    END IF;
    RETURN holder;
END $$;

-- One job, its options already resolved: take its uniqueness lock (until_executed types), then
-- acquire-or-park (limited types), then send. A job with uniqueness draws its id first, so the
-- lock names its owner before the message exists; the message is sent with that id. taken: the
-- id of the job when the caller has taken its uniqueness lock already (lockgate._enqueue_each),
-- else NULL.
CREATE OR REPLACE FUNCTION lockgate._enqueue_one(
    jt lockgate.job_types, args jsonb, queue text, priority smallint, vt timestamptz, immediate boolean, explicit_key text,
    explicit_ukey text, batch bigint, taken bigint,
    OUT msg_id bigint, OUT job_id bigint, OUT status text
) LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    headers jsonb := lockgate._headers(jt.name, priority);
    key text;
    ukey text;
    t record;
    acquired boolean;
BEGIN
    IF batch IS NOT NULL THEN
        headers := headers || jsonb_build_object('batch', batch);
    END IF;
    IF jt.unique_mode IS NOT NULL THEN
        ukey := lockgate._unique_key(jt, args, explicit_ukey);
        IF jt.unique_mode = 'while_executing' THEN
            -- Taken by the claim that starts a run (lockgate._start_unique).
            headers := headers || jsonb_build_object('wkey', ukey);
        ELSE
            IF taken IS NOT NULL THEN
                job_id := taken;
            ELSE
                t := lockgate._take_until_executed(jt, ukey, queue);
                job_id := t.job_id;
                IF t.holder IS NOT NULL THEN
                    job_id := lockgate._duplicate_of(jt, ukey, t.holder);
                    status := 'duplicate';
                    RETURN;
                END IF;
            END IF;
            headers := headers || jsonb_build_object('ukey', ukey);
        END IF;
    END IF;
    IF jt.concurrency_limit IS NOT NULL THEN
        key := lockgate._concurrency_key(jt, args, explicit_key);
        IF length(key) > 512 THEN
            RAISE EXCEPTION 'lockgate: the concurrency key derived from the arguments is % characters, more than the 512 allowed', length(key)
                USING ERRCODE = 'LG003', DETAIL = format('key paths %s of job type "%s"', jt.concurrency_key, jt.name);
        END IF;
        headers := headers || jsonb_build_object('ckey', key);
        IF jt.concurrency_key_version <> 0 THEN
            headers := headers || jsonb_build_object('kv', jt.concurrency_key_version);
        END IF;
        IF explicit_key IS NOT NULL THEN
            -- Kept as given when the type's key paths change (a claim re-derives the others).
            headers := headers || jsonb_build_object('ckey_explicit', true);
        END IF;
        -- Permits of the key's jobs that finished while another transaction held its row go
        -- back first, to the key's parked jobs (one index probe when there are none). Looked for
        -- again when the key is full: a job of the key may have finished while this enqueue
        -- waited for the row, and only now that it holds the row is that lease sure to be seen.
        PERFORM lockgate._give_back_finished(key);
        acquired := lockgate._acquire(key, jt.concurrency_limit, jt.name);
        IF NOT acquired THEN
            PERFORM lockgate._give_back_finished(key);
            acquired := lockgate._acquire(key, jt.concurrency_limit, jt.name);
        END IF;
        IF NOT acquired AND jt.concurrency_on_conflict <> 'block'
           AND current_setting('transaction_isolation') <> 'read committed'
           -- (headers->>'ckey' is the key: a bare "key" is also the leases' column)
           AND EXISTS (SELECT 1 FROM lockgate.leases l WHERE l.key = headers->>'ckey' AND l.finished_at IS NOT NULL) THEN
            -- Full only until a finished job's permit goes back, which this snapshot cannot do
            -- (lockgate._give_back_finished): a discard or LG004 now would refuse a job while
            -- nothing of the key may be running (review helper-76). A serialization failure is
            -- what such a transaction is ready to retry.
            RAISE EXCEPTION 'lockgate: key "%" holds permits of finished jobs not yet given back, which a % transaction cannot give back', key, current_setting('transaction_isolation')
                USING ERRCODE = '40001',
                      HINT = 'retry the transaction, or enqueue at READ COMMITTED; such permits go back at the key''s next READ COMMITTED enqueue or completion, when a running lockgate run is told of the finish, or at its next sweep';
        END IF;
        IF NOT acquired THEN
            IF jt.concurrency_on_conflict = 'raise' THEN
                RAISE EXCEPTION 'lockgate: concurrency limit % reached for key "%"', jt.concurrency_limit, key
                    USING ERRCODE = 'LG004';
            END IF;
            -- No message yet: the job's id comes from the sequence every msg_id comes from.
            job_id := COALESCE(job_id, nextval('lockgate.job_id_seq'));
            status := 'discarded';
            IF jt.concurrency_on_conflict = 'block' THEN
                INSERT INTO lockgate.parked (key, queue, job_type, job_id, args, headers, priority, run_at)
                VALUES (key, _enqueue_one.queue, jt.name, _enqueue_one.job_id, args,
                        headers || jsonb_build_object('job_id', _enqueue_one.job_id, 'enqueued_at', clock_timestamp()),
                        _enqueue_one.priority, vt);
                -- The queue, looked for again: a drop of it (lockgate.drop_queue) holds
                -- lockgate.parked against this insert while it counts, so an insert that waited
                -- for it finds the queue gone now, and fails rather than park a job for no queue
                -- (review helper-94). Its table is looked up in the catalog as it is now, which an
                -- older snapshot (REPEATABLE READ, SERIALIZABLE) still showing the queue's row
                -- does not hide (review helper-95). On the parking path only.
                IF to_regclass(format('pgmq.%I', 'q_' || _enqueue_one.queue)) IS NULL
                   OR NOT EXISTS (SELECT 1 FROM lockgate.queues q WHERE q.name = _enqueue_one.queue) THEN
                    RAISE EXCEPTION 'lockgate: queue "%" does not exist (it was dropped)', _enqueue_one.queue
                        USING ERRCODE = 'LG001';
                END IF;
                status := 'parked';
                IF batch IS NOT NULL THEN
                    -- msg_id 0: no message yet; its promotion writes it in (design §111).
                    INSERT INTO lockgate.batch_jobs (queue, job_id, batch_id, msg_id)
                    VALUES (_enqueue_one.queue, _enqueue_one.job_id, batch, 0);
                END IF;
                -- A parked job keeps its uniqueness lock, with no message until it is promoted.
                UPDATE lockgate.unique_locks u SET msg_id = NULL WHERE u.key = ukey AND ukey IS NOT NULL AND headers ? 'ukey';
            ELSIF headers ? 'ukey' THEN
                -- Discarded by its concurrency policy: it gives its uniqueness lock back.
                DELETE FROM lockgate.unique_locks u WHERE u.key = ukey;
            END IF;
            RETURN;
        END IF;
    END IF;
    IF job_id IS NULL AND batch IS NOT NULL THEN
        job_id := nextval('lockgate.job_id_seq');
    END IF;
    IF job_id IS NULL THEN
        EXECUTE lockgate._enqueue_step(queue, true)
           INTO msg_id
          USING vt, args, headers;
    ELSE
        EXECUTE format('INSERT INTO %s (msg_id, vt, message, headers) VALUES ($4, $1, $2, $3) RETURNING msg_id',
                       lockgate._queue_table(queue, 'q'))
           INTO msg_id
          USING vt, args, headers, job_id;
    END IF;
    job_id := msg_id;
    IF key IS NOT NULL THEN
        PERFORM lockgate._add_lease(key, queue, msg_id, vt, jt.concurrency_duration_ms, jt.name);
    END IF;
    IF batch IS NOT NULL THEN
        INSERT INTO lockgate.batch_jobs (queue, job_id, batch_id, msg_id)
        VALUES (_enqueue_one.queue, _enqueue_one.job_id, batch, msg_id);
    END IF;
    IF immediate THEN
        PERFORM pg_notify('lockgate_' || queue, '');
    END IF;
    status := 'enqueued';
END $$;

-- One job, waking idle workers in the transaction when notify. The common case, an unlimited type
-- enqueued with no options, takes one function body: the type's queue exists (job_types.queue
-- references lockgate.queues), so it goes straight to the queue's one-job enqueue step
-- (lockgate._enqueue_step); everything else goes through _resolve_options and _enqueue_one.
CREATE OR REPLACE FUNCTION lockgate.enqueue(job_type text, args jsonb, options jsonb, notify boolean)
RETURNS TABLE (queue text, msg_id bigint, job_id bigint, status text) LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    jt lockgate.job_types;
    o record;
    r record;
BEGIN
    SELECT * INTO jt FROM lockgate.job_types t WHERE t.name = enqueue.job_type;
    IF NOT FOUND THEN
        jt := lockgate.job_policy(job_type);  -- raises LG002 naming the type
    END IF;
    IF args IS NULL OR jsonb_typeof(args) <> 'object' OR pg_column_size(args) > 1048576 THEN
        PERFORM lockgate._check_args(args);
    END IF;
    IF jt.concurrency_limit IS NULL AND jt.unique_mode IS NULL AND (options IS NULL OR options = '{}') THEN
        queue := jt.queue;
        EXECUTE lockgate._enqueue_step(jt.queue, true)
           INTO msg_id
          USING clock_timestamp(), args, lockgate._headers(jt.name, jt.priority);
        job_id := msg_id;
        IF notify THEN
            PERFORM pg_notify('lockgate_' || jt.queue, '');
        END IF;
        status := 'enqueued';
        RETURN NEXT;
        RETURN;
    END IF;
    o := lockgate._resolve_options(jt, options);
    IF o.batch IS NOT NULL THEN
        PERFORM lockgate._join_batch(o.batch);
    END IF;
    r := lockgate._enqueue_one(jt, args, o.queue, o.priority, o.vt, o.immediate AND notify, o.ckey, o.ukey, o.batch, NULL);
    queue := o.queue;
    msg_id := r.msg_id;
    job_id := r.job_id;
    status := r.status;
    RETURN NEXT;
END $$;

-- The jobs of args, of a type that is limited or unique or joining a batch, each through
-- lockgate._enqueue_one with the type and options already resolved (jt and the rest, as
-- lockgate._resolve_options returns them); rows come back in the order of args. Keys are taken
-- in the order every enqueue takes them, so that concurrent calls cannot close a cycle: unique
-- keys first, then concurrency keys, each kind in key order. A type with both takes all its
-- unique keys first (lockgate._take_until_executed), then enqueues the jobs that are no
-- duplicates in concurrency-key order: taking a job's two keys before the next job's, a call
-- could wait for a unique key while holding a key's row another call waited for, and PostgreSQL
-- failed one of them as a deadlock (review F7). Of two jobs of the call with the same unique key,
-- the one with the lower concurrency key, then the earlier, takes it, and each concurrency key's
-- permits go to its jobs in unique-key order, as before. A type that rejects duplicates fails
-- with LG005 as soon as a key is held by a job of another call (before, a job that exceeded a
-- concurrency limit of a raising type earlier in the order failed the call with LG004 first).
-- The arguments are
-- checked first, all of them, then the keys derived from them. Callers: lockgate.enqueue_many and lockgate._enqueue_many_and_wake,
-- which resolve the type and options once, so that the queue they report is the one the jobs
-- went to.
CREATE OR REPLACE FUNCTION lockgate._enqueue_each(
    jt lockgate.job_types, args jsonb[], queue text, priority smallint, vt timestamptz, immediate boolean, ckey text,
    ukey text, batch bigint)
RETURNS TABLE (msg_id bigint, job_id bigint, status text) LANGUAGE plpgsql AS $$
DECLARE
    r record;
    t record;
    one record;
    n integer := cardinality(args);
    ids bigint[];
    holders bigint[];
    msg_ids bigint[];
    job_ids bigint[];
    statuses text[];
    discarded bigint[] := '{}';
    key text;
BEGIN
    PERFORM lockgate._check_all_args(args);
    PERFORM lockgate._check_derived_keys(jt, args, _enqueue_each.ckey, _enqueue_each.ukey);
    IF jt.unique_mode = 'until_executed' AND jt.unique_on_conflict = 'reject' AND n > 1 THEN
        -- A key the call repeats: its later job met the earlier one as the holder and named it,
        -- an id the failed call never enqueued (review helper-141 F7).
        key := (SELECT k FROM unnest(args) a(v), lockgate._unique_key(jt, a.v, _enqueue_each.ukey) k
                 GROUP BY k HAVING count(*) > 1 ORDER BY k LIMIT 1);
        IF key IS NOT NULL THEN
            RAISE EXCEPTION 'lockgate: unique key "%" of job type "%" is given to more than one job of this call', key, jt.name
                USING ERRCODE = 'LG003',
                      DETAIL = 'the type rejects duplicates, so each unique key may be enqueued once: nothing of this call was enqueued';
        END IF;
    END IF;
    IF batch IS NOT NULL THEN
        PERFORM lockgate._join_batch(batch);
    END IF;
    IF jt.unique_mode = 'until_executed' AND jt.concurrency_limit IS NOT NULL AND n > 1 THEN
        ids := array_fill(NULL::bigint, ARRAY[n]);
        holders := ids;
        msg_ids := ids;
        job_ids := ids;
        statuses := array_fill(NULL::text, ARRAY[n]);
        FOR r IN
            SELECT a.v, a.i FROM unnest(args) WITH ORDINALITY a(v, i)
             ORDER BY lockgate._key_of(jt.name, jt.unique_key, a.v, _enqueue_each.ukey),
                      lockgate._concurrency_key(jt, a.v, _enqueue_each.ckey), a.i
        LOOP
            key := lockgate._unique_key(jt, r.v, _enqueue_each.ukey);
            t := lockgate._take_until_executed(jt, key, _enqueue_each.queue);
            IF t.holder IS NOT NULL AND array_position(ids, t.holder) IS NULL THEN
                -- Held by a job of another call: a type that rejects duplicates fails here, before
                -- it waits for anything more.
                PERFORM lockgate._duplicate_of(jt, key, t.holder);
            END IF;
            ids[r.i] := t.job_id;
            holders[r.i] := t.holder;
        END LOOP;
        -- Permits in concurrency-key order, each key's jobs in the order the single path took
        -- them (unique key, position): the same jobs get them.
        FOR r IN
            SELECT a.v, a.i FROM unnest(args) WITH ORDINALITY a(v, i)
             ORDER BY lockgate._concurrency_key(jt, a.v, _enqueue_each.ckey),
                      lockgate._key_of(jt.name, jt.unique_key, a.v, _enqueue_each.ukey), a.i
        LOOP
            IF holders[r.i] IS NOT NULL AND NOT holders[r.i] = ANY (discarded) THEN
                job_ids[r.i] := lockgate._duplicate_of(jt, lockgate._unique_key(jt, r.v, _enqueue_each.ukey), holders[r.i]);
                statuses[r.i] := 'duplicate';
            ELSE
                -- A job whose unique key an earlier job of this call took, then gave back when its
                -- concurrency policy discarded it, takes the key itself: no other transaction can
                -- hold a key this one deleted, so this never waits.
                one := lockgate._enqueue_one(jt, r.v, _enqueue_each.queue, _enqueue_each.priority, _enqueue_each.vt,
                                           _enqueue_each.immediate, _enqueue_each.ckey, _enqueue_each.ukey,
                                           _enqueue_each.batch, CASE WHEN holders[r.i] IS NULL THEN ids[r.i] END);
                msg_ids[r.i] := one.msg_id;
                job_ids[r.i] := one.job_id;
                statuses[r.i] := one.status;
                IF one.status = 'discarded' THEN
                    discarded := discarded || one.job_id;
                END IF;
            END IF;
        END LOOP;
        RETURN QUERY SELECT * FROM unnest(msg_ids, job_ids, statuses);
        RETURN;
    END IF;
    FOR r IN
        SELECT e.msg_id, e.job_id, e.status
          FROM (SELECT a.v, a.i FROM unnest(args) WITH ORDINALITY a(v, i)
                 ORDER BY CASE WHEN jt.unique_mode = 'until_executed' THEN lockgate._key_of(jt.name, jt.unique_key, a.v, _enqueue_each.ukey) END,
                          CASE WHEN jt.concurrency_limit IS NOT NULL THEN lockgate._concurrency_key(jt, a.v, _enqueue_each.ckey) END,
                          a.i) AS ordered,
               LATERAL lockgate._enqueue_one(jt, ordered.v, _enqueue_each.queue, _enqueue_each.priority, _enqueue_each.vt,
                                             _enqueue_each.immediate, _enqueue_each.ckey, _enqueue_each.ukey,
                                             _enqueue_each.batch, NULL) e
         ORDER BY ordered.i
    LOOP
        msg_id := r.msg_id;
        job_id := r.job_id;
        status := r.status;
        RETURN NEXT;
    END LOOP;
END $$;

-- Many jobs of one type sharing one options object, in one call; rows come back in the order
-- of args. Unlimited types without uniqueness or batch take one set-based INSERT (the queue's
-- enqueue step, lockgate._enqueue_step), which checks the arguments as it goes and raises for
-- the first bad one afterwards (the raise undoes the insert); its rows come back in insertion
-- order, the order of args. Other types take each job through lockgate._enqueue_each.
CREATE OR REPLACE FUNCTION lockgate.enqueue_many(job_type text, args jsonb[], options jsonb, notify boolean)
RETURNS TABLE (queue text, msg_id bigint, job_id bigint, status text) LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    jt lockgate.job_types := lockgate.job_policy(job_type);
    o record := lockgate._resolve_options(jt, options);
    inserted bigint;
BEGIN
    IF jt.concurrency_limit IS NOT NULL OR jt.unique_mode IS NOT NULL OR o.batch IS NOT NULL THEN
        RETURN QUERY
        SELECT o.queue, e.msg_id, e.job_id, e.status
          FROM lockgate._enqueue_each(jt, args, o.queue, o.priority, o.vt, o.immediate AND notify, o.ckey, o.ukey, o.batch)
               WITH ORDINALITY AS e(msg_id, job_id, status, i)
         ORDER BY e.i;
        RETURN;
    END IF;
    -- Every job of the call has the same headers (its id is its msg_id): nothing is built per row.
    RETURN QUERY EXECUTE format('WITH e(id) AS (%s) SELECT $4::text, e.id, e.id, ''enqueued''::text FROM e',
                                lockgate._enqueue_step(o.queue, false))
      USING o.vt, args, lockgate._headers(jt.name, o.priority), o.queue;
    GET DIAGNOSTICS inserted = ROW_COUNT;
    IF inserted < cardinality(args) THEN
        PERFORM lockgate._check_all_args(args);  -- raises for the first bad one, undoing the insert
    END IF;
    IF o.immediate AND notify AND inserted > 0 THEN
        PERFORM pg_notify('lockgate_' || o.queue, '');
    END IF;
END $$;

-- The forms every producer calls: they wake idle workers in the caller's transaction. Separate
-- functions, not a defaulted fourth argument, so that objects depending on them (a BEGIN ATOMIC
-- function, granted privileges) stay as they were. PL/pgSQL, which keeps its statement's plan for
-- the session: about 5 us a call, where a SQL function, planned at every call, cost 15 us.
CREATE OR REPLACE FUNCTION lockgate.enqueue(job_type text, args jsonb DEFAULT '{}', options jsonb DEFAULT '{}')
RETURNS TABLE (queue text, msg_id bigint, job_id bigint, status text) LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY SELECT * FROM lockgate.enqueue(job_type, args, options, true);
END $$;

CREATE OR REPLACE FUNCTION lockgate.enqueue_many(job_type text, args jsonb[], options jsonb DEFAULT '{}')
RETURNS TABLE (queue text, msg_id bigint, job_id bigint, status text) LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY SELECT * FROM lockgate.enqueue_many(job_type, args, options, true);
END $$;

-- Notifies queue's channel in the caller's transaction, unless another transaction is doing so
-- through this function at this moment; true when it notified. PostgreSQL holds its notify lock
-- from before a notifying transaction's commit record until that record is flushed, so notifying
-- commits go one flush after another, where other commits share their flushes: the Rust
-- Client's enqueue calls this in its own transaction (its wake-up then arrives with the commit,
-- with no statement of its own after it), and sends lockgate.wake after the commit when this
-- returns false, so that a database's concurrent producers never queue on that lock behind each
-- other (the notify lock is one for the whole server; this one, per database). The advisory
-- lock taken here (never waited for; a two-key lock, apart from every one-key advisory lock,
-- lockgate's per-queue ones included) is held to the end of the transaction, as the notify lock
-- is. The notifying transaction then waits for the notify lock at its commit, which no
-- lock_timeout may turn into a failed enqueue: it is set to 0 for the rest of the transaction.
-- Run it outside a transaction block: inside one, it holds the lock until the caller commits.
-- Callers: the Rust Client's enqueues in their own transaction.
CREATE OR REPLACE FUNCTION lockgate._notify_unless_busy(queue text)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('lockgate'), 1) THEN
        RETURN false;
    END IF;
    PERFORM set_config('lock_timeout', '0', true);
    PERFORM pg_notify('lockgate_' || queue, '');
    RETURN true;
END $$;

-- The Rust Client's bulk enqueue: what lockgate.enqueue_many does with notify false, then, when
-- runs_now (the caller's reading of its options) and a job was enqueued, lockgate._notify_unless_busy
-- in the same transaction; woken says whether it notified (when not, the caller sends
-- lockgate.wake after the commit). One row of arrays in the order of args, not a row per job:
-- rows passed up through each function's result set and then the caller's statement
-- (materialised to find the first enqueued job, sorted back into order) cost 0.6 of the 3.5 ms
-- a call of 1,000 jobs took (docs/benchmarks.md, thirteenth session). queue is where the jobs
-- went (the type and options are resolved once); msg_ids[i] is the message of args[i] (NULL when
-- parked or a duplicate). For an unlimited type without uniqueness or batch, job_ids and
-- statuses are NULL: every job was enqueued, its msg_id its id, and only the ids need to cross
-- the wire. For other types, job_ids[i] and statuses[i] are what lockgate.enqueue_many returns,
-- whatever the outcomes. SECURITY DEFINER, as lockgate.enqueue_many: the lock_timeout that
-- _notify_unless_busy sets still lasts to the caller's commit (a function's SET clause restores
-- only the settings it names). Run it outside a transaction block, as _notify_unless_busy.
-- Callers: the Rust Client (lockgate_sql::enqueue_many_and_wake).
CREATE OR REPLACE FUNCTION lockgate._enqueue_many_and_wake(job_type text, args jsonb[], options jsonb, runs_now boolean,
    OUT queue text, OUT msg_ids bigint[], OUT job_ids bigint[], OUT statuses text[], OUT woken boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    jt lockgate.job_types := lockgate.job_policy(job_type);
    o record := lockgate._resolve_options(jt, options);
BEGIN
    queue := o.queue;
    -- Set by an IF, not an AND: the notification is a side effect, and SQL promises no order of
    -- evaluation for AND.
    woken := false;
    IF jt.concurrency_limit IS NOT NULL OR jt.unique_mode IS NOT NULL OR o.batch IS NOT NULL THEN
        SELECT array_agg(e.msg_id ORDER BY e.i), array_agg(e.job_id ORDER BY e.i), array_agg(e.status ORDER BY e.i)
          INTO msg_ids, job_ids, statuses
          FROM lockgate._enqueue_each(jt, args, o.queue, o.priority, o.vt, false, o.ckey, o.ukey, o.batch)
               WITH ORDINALITY AS e(msg_id, job_id, status, i);
        msg_ids := COALESCE(msg_ids, '{}');  -- no args: no ids (and, vacuously, every job enqueued)
        IF runs_now AND 'enqueued' = ANY(statuses) THEN
            woken := lockgate._notify_unless_busy(queue);
        END IF;
        RETURN;
    END IF;
    -- The path of lockgate.enqueue_many for these types, its ids gathered in insertion order
    -- (the order of args).
    EXECUTE format('WITH e(id) AS (%s) SELECT ARRAY(SELECT e.id FROM e)', lockgate._enqueue_step(o.queue, false))
       INTO msg_ids
      USING o.vt, args, lockgate._headers(jt.name, o.priority);
    IF cardinality(msg_ids) < cardinality(args) THEN
        PERFORM lockgate._check_all_args(args);  -- raises for the first bad one, undoing the insert
    END IF;
    IF runs_now AND cardinality(msg_ids) > 0 THEN
        woken := lockgate._notify_unless_busy(queue);
    END IF;
END $$;

-- Wakes the workers idle on a queue, for jobs enqueued with notify false once their transaction
-- has committed (so that a woken worker finds them). Run alone, its transaction writes nothing
-- but the commit record PostgreSQL gives a notifying transaction, which the commit does not wait
-- to flush (only a transaction that wrote other WAL does), so it holds the notify lock for no
-- flush. Locks: PostgreSQL's notify lock, at commit. Callers: the Rust Client, SQL producers
-- that enqueue with notify false.
CREATE OR REPLACE FUNCTION lockgate.wake(queue text)
RETURNS void LANGUAGE sql AS $$
    SELECT pg_notify('lockgate_' || queue, '');
$$;

-- Every queue's enqueue steps, written again with each install of these functions (not for a
-- queue whose table was dropped behind lockgate's back: nothing can be enqueued into it).
SELECT lockgate._install_enqueue_steps(q) FROM lockgate._live_queues() q;

-- Only the roles granted them run the functions that write as lockgate's owner (README, "A
-- producer's role"); PUBLIC may run every other function, which writes as its caller.
REVOKE EXECUTE ON FUNCTION lockgate.enqueue(text, jsonb, jsonb, boolean),
                           lockgate.enqueue_many(text, jsonb[], jsonb, boolean),
                           lockgate._enqueue_many_and_wake(text, jsonb[], jsonb, boolean) FROM PUBLIC;
