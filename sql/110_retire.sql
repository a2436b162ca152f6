-- Retiring a job type or a queue: the inverse of define_job_type and create_queue, refused while
-- anything still needs what is removed (docs/design.md §90). Neither waits for producers: a job
-- enqueued by a transaction that read the type before its removal committed is claimed as a job
-- of a type no one defines, and dead-lettered as such (unknown_job_type), not lost; stop the
-- producers of what is retired first. Both run at READ COMMITTED only: their counts must see what
-- committed before their locks, which an older snapshot does not (review helper-91 of §88 found
-- the same for a catalog read; helper-93 lost a committed job so). Each waits for a lock at most
-- the caller's lock_timeout, or 5 s when it has none, and leaves the caller's setting as it was.

-- Refuses a transaction that does not read each statement's committed state, naming the function.
CREATE OR REPLACE FUNCTION lockgate._retire_at_read_committed(what text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'lockgate: % needs READ COMMITTED, not %: at an older snapshot it would miss jobs committed since',
            what, current_setting('transaction_isolation')
            USING ERRCODE = '40001',
                  HINT = 'run it in a transaction begun with BEGIN ISOLATION LEVEL READ COMMITTED (lockgate queue drop and lockgate undefine do)';
    END IF;
END $$;

-- The caller's lock_timeout, and 5 s from now on in this transaction when it has none.
CREATE OR REPLACE FUNCTION lockgate._retire_lock_timeout()
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    caller text := current_setting('lock_timeout');
BEGIN
    IF caller IN ('0', '0ms') THEN
        PERFORM set_config('lock_timeout', '5s', true);
    END IF;
    RETURN caller;
END $$;

-- The first ten of names, comma-separated, and how many more there are: a refusal names what
-- holds it, and stays readable with thousands (review helper-97).
CREATE OR REPLACE FUNCTION lockgate._listed(names text[])
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT array_to_string(names[1:10], ', ')
           || CASE WHEN cardinality(names) > 10 THEN format(' and %s more', cardinality(names) - 10) ELSE '' END
$$;

-- Removes job type `name`'s definition; false when there is none. Refused (SQLSTATE 55006,
-- object_in_use, with the count of each) while it has jobs queued, scheduled, retrying or running
-- in any queue, parked jobs, dead letters, recurring tasks, or unfinished batches that name it as
-- a callback: each of those would otherwise meet a type no one defines. Its archived jobs stay,
-- as history. Reads every queue's table whole (the type is in the headers, which no index
-- covers): an operator's call, not a hot path.
-- Locks: the type's row FOR UPDATE, then reads only. A definition of the type waits for it, and so
-- does whatever names the type without writing a job of it, each holding the row FOR KEY SHARE
-- until its commit: define_recurring, create_batch's callbacks, dlq_retry (design §91). Callers:
-- lockgate undefine, SQL operators.
CREATE OR REPLACE FUNCTION lockgate.remove_job_type(name text)
RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    caller_lock_timeout text;
    q text;
    n bigint;
    jobs bigint := 0;
    parked bigint;
    parked_before bigint;
    dead bigint;
    tasks text[];
    batches bigint[];
    uses text[] := '{}';
BEGIN
    PERFORM lockgate._retire_at_read_committed('remove_job_type');
    caller_lock_timeout := lockgate._retire_lock_timeout();
    BEGIN
        PERFORM 1 FROM lockgate.job_types t WHERE t.name = remove_job_type.name FOR UPDATE;
    EXCEPTION WHEN lock_not_available THEN
        -- Named, as a drop's timeout is (review helper-97: the bare lock timeout).
        RAISE EXCEPTION 'lockgate: could not lock job type "%" within %: open transactions are defining it or naming it (a recurring task, a batch callback, a dead letter''s retry); try again when they have ended', name, current_setting('lock_timeout')
            USING ERRCODE = '55P03';
    END;
    IF NOT FOUND THEN
        PERFORM set_config('lock_timeout', caller_lock_timeout, true);
        RETURN false;
    END IF;
    -- Counted in an order no job can slip through while the counts run (review helper-96: a
    -- batch's callback enqueued, or a parked job promoted, into a queue already counted, was seen
    -- nowhere). Batches first, those unfinished or with callbacks pending: a callback job is
    -- enqueued by the transaction that clears its batch's callbacks_pending, so it is in a queue
    -- for every count after a count that saw the batch without pending callbacks. Parked jobs before the queues and again after them: a job moves between the two
    -- both ways (a promotion, a park at claim), and is seen in one of the three counts unless it
    -- moves twice while they run. Dead letters after the queues (a failure moves a job from a
    -- queue to them; a retry the other way waits for the type's row, above).
    batches := ARRAY(SELECT b.id FROM lockgate.batches b
                      WHERE (b.state <> 'finished' OR b.callbacks_pending)
                        AND remove_job_type.name IN (b.on_finish, b.on_success, b.on_failure)
                      ORDER BY 1);
    SELECT count(*) INTO parked_before FROM lockgate.parked p WHERE p.job_type = remove_job_type.name;
    FOR q IN SELECT lockgate._live_queues() LOOP
        BEGIN
            EXECUTE format('SELECT count(*) FROM pgmq.%I m WHERE m.headers->>''type'' = $1', 'q_' || q) INTO n USING name;
        EXCEPTION WHEN undefined_table THEN
            -- Dropped since the list was read (review helper-97: the removal failed with 42P01); a
            -- drop goes through only with its table empty, so there is nothing of this type to count.
            n := 0;
        END;
        jobs := jobs + n;
    END LOOP;
    SELECT count(*) INTO parked FROM lockgate.parked p WHERE p.job_type = remove_job_type.name;
    parked := GREATEST(parked, parked_before);
    SELECT count(*) INTO dead FROM lockgate.dead_letters d WHERE d.job_type = remove_job_type.name;
    tasks := ARRAY(SELECT r.name FROM lockgate.recurring_tasks r WHERE r.job_type = remove_job_type.name ORDER BY 1);
    IF jobs > 0 THEN
        uses := uses || (jobs || ' queued, scheduled, retrying or running job(s)');
    END IF;
    IF parked > 0 THEN
        uses := uses || (parked || ' parked job(s)');
    END IF;
    IF dead > 0 THEN
        uses := uses || (dead || ' dead letter(s)');
    END IF;
    IF cardinality(tasks) > 0 THEN
        uses := uses || ('recurring task(s) ' || lockgate._listed(tasks));
    END IF;
    IF cardinality(batches) > 0 THEN
        uses := uses || ('the callbacks of unfinished batch(es) ' || lockgate._listed(batches::text[]));
    END IF;
    IF cardinality(uses) > 0 THEN
        RAISE EXCEPTION 'lockgate: job type "%" is still in use: %. Let its jobs finish or cancel them (lockgate jobs --type % lists them), purge or retry its dead letters and remove its recurring tasks first', name, array_to_string(uses, '; '), name
            USING ERRCODE = '55006';
    END IF;
    DELETE FROM lockgate.job_types t WHERE t.name = remove_job_type.name;
    PERFORM set_config('lock_timeout', caller_lock_timeout, true);
    RETURN true;
END $$;

-- Locks lockgate.parked (SHARE), queue table `tbl` and its archive (ACCESS EXCLUSIVE, each when it
-- exists) and the queue's row in lockgate.queues (FOR UPDATE) for a drop of `queue`, all or none.
-- lockgate.parked is waited for in line (parking anywhere holds it for a moment, and a NOWAIT lost
-- to every one of them: review helper-95); the tables and the row, with NOWAIT. A try that cannot
-- have them lets go of all (it runs in a subtransaction) and the next comes 10 ms later, until the
-- lock budget (lock_timeout, 5 s when the caller has none) is spent. A drop that waited for the
-- table while holding lockgate.parked deadlocked with a completion promoting into the queue
-- (parked, then the table) and with a producer that enqueued into it, then parked for it, and a
-- worker's completion could be the victim (review helper-94); so it did, at pgmq.drop_queue, with
-- a reader of the archive that then parked (review helper-97). Waiting for lockgate.parked holding
-- nothing but the queue name's advisory lock, and never for the tables or the row, the drop is in
-- no cycle. The
-- row is held against definitions that name the queue without writing to it (define_recurring,
-- define_job_type's foreign key): each holds it FOR KEY SHARE, so the drop counts what they
-- commit, or they find the queue gone (design §91).
DROP FUNCTION IF EXISTS lockgate._lock_for_drop(text);
CREATE OR REPLACE FUNCTION lockgate._lock_for_drop(queue text, tbl text)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    budget interval := CASE WHEN current_setting('lock_timeout') IN ('0', '0ms') THEN interval '5 seconds'
                            ELSE current_setting('lock_timeout')::interval END;
    deadline timestamptz := clock_timestamp() + budget;
    left_ms bigint;
    atbl text := format('pgmq.%I', 'a_' || queue);
BEGIN
    LOOP
        left_ms := GREATEST(1, ceil(extract(epoch FROM deadline - clock_timestamp()) * 1000))::bigint;
        PERFORM set_config('lock_timeout', left_ms || 'ms', true);
        BEGIN
            LOCK TABLE lockgate.parked IN SHARE MODE;
            IF to_regclass(tbl) IS NOT NULL THEN
                EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE NOWAIT', tbl);
            END IF;
            -- The archive too, which pgmq.drop_queue drops: waited for there, holding
            -- lockgate.parked, a reader of the archive that then parked closed a cycle (review
            -- helper-97).
            IF to_regclass(atbl) IS NOT NULL THEN
                EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE NOWAIT', atbl);
            END IF;
            PERFORM 1 FROM lockgate.queues q WHERE q.name = _lock_for_drop.queue FOR UPDATE NOWAIT;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            IF clock_timestamp() >= deadline THEN
                RAISE EXCEPTION 'lockgate: could not lock %, its archive, its row in lockgate.queues and lockgate.parked within %: open transactions are using them; try again when they have ended', tbl, budget
                    USING ERRCODE = '55P03';
            END IF;
        END;
        PERFORM pg_sleep(0.01);
    END LOOP;
END $$;

-- Drops queue `queue`: its PGMQ tables (the archive, its finished jobs' history, with them), its
-- steps and its row; false when there is no such queue. Refused (SQLSTATE 55006, naming each)
-- while job types are defined on it, while it holds messages (queued, scheduled, retrying or
-- running), parked jobs, dead letters or leases, while recurring tasks enqueue into it, while
-- unique locks name it, or while a registered process's pool serves it (a running pool would
-- fail its claims from then on). The queue's table (ACCESS EXCLUSIVE) and lockgate.parked (SHARE,
-- for the moment the drop takes: parking waits, in every queue) are locked before anything is
-- counted (lockgate._lock_for_drop), so a message or a parked job committed by a transaction that
-- was writing it is counted, not dropped: a limited job enqueued into the queue parks without
-- touching the queue's table (review helper-93), and one that parks after the drop waited for its
-- lock finds the queue gone (lockgate._enqueue_one looks again after its insert).
-- Locks: create_queue's advisory lock on the name, then lockgate.parked, the queue's table and its
-- row.
-- Callers: lockgate queue drop, SQL operators.
CREATE OR REPLACE FUNCTION lockgate.drop_queue(queue text)
RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    caller_lock_timeout text;
    tbl text;
    n bigint := 0;
    types text[];
    tasks text[];
    pools text[];
    uses text[] := '{}';
    step record;
BEGIN
    IF queue IS NULL THEN
        RETURN false;
    END IF;
    tbl := format('pgmq.%I', 'q_' || queue);
    PERFORM lockgate._retire_at_read_committed('drop_queue');
    caller_lock_timeout := lockgate._retire_lock_timeout();
    PERFORM pg_advisory_xact_lock(hashtext('lockgate.queue:' || queue));
    -- Looked for under the lock: a drop that waited for another drop of the same queue finds
    -- nothing left (review helper-93: it said true).
    IF NOT EXISTS (SELECT 1 FROM lockgate.queues q WHERE q.name = drop_queue.queue) THEN
        PERFORM set_config('lock_timeout', caller_lock_timeout, true);
        RETURN false;
    END IF;
    PERFORM lockgate._lock_for_drop(queue, tbl);
    IF to_regclass(tbl) IS NOT NULL THEN
        EXECUTE format('SELECT count(*) FROM %s', tbl) INTO n;
    END IF;
    types := ARRAY(SELECT t.name FROM lockgate.job_types t WHERE t.queue = drop_queue.queue ORDER BY 1);
    tasks := ARRAY(SELECT r.name FROM lockgate.recurring_tasks r WHERE r.options->>'queue' = drop_queue.queue ORDER BY 1);
    pools := ARRAY(SELECT format('%s (pid %s on %s)', p.name, p.pid, p.host) FROM lockgate.processes p
                    WHERE p.kind = 'worker' AND p.metadata->'queues' ? drop_queue.queue ORDER BY p.id);
    IF cardinality(types) > 0 THEN
        uses := uses || ('job type(s) ' || lockgate._listed(types) || ' defined on it');
    END IF;
    IF n > 0 THEN
        uses := uses || (n || ' queued, scheduled, retrying or running job(s)');
    END IF;
    SELECT count(*) INTO n FROM lockgate.parked p WHERE p.queue = drop_queue.queue;
    IF n > 0 THEN
        uses := uses || (n || ' parked job(s)');
    END IF;
    SELECT count(*) INTO n FROM lockgate.dead_letters d WHERE d.queue = drop_queue.queue;
    IF n > 0 THEN
        uses := uses || (n || ' dead letter(s)');
    END IF;
    SELECT count(*) INTO n FROM lockgate.leases l WHERE l.queue = drop_queue.queue;
    IF n > 0 THEN
        uses := uses || (n || ' lease(s) not yet freed');
    END IF;
    SELECT count(*) INTO n FROM lockgate.unique_locks u WHERE u.queue = drop_queue.queue;
    IF n > 0 THEN
        uses := uses || (n || ' unique lock(s)');
    END IF;
    IF cardinality(tasks) > 0 THEN
        uses := uses || ('recurring task(s) ' || lockgate._listed(tasks));
    END IF;
    IF cardinality(pools) > 0 THEN
        uses := uses || ('the pool(s) ' || lockgate._listed(pools) || ' serving it');
    END IF;
    IF cardinality(uses) > 0 THEN
        RAISE EXCEPTION 'lockgate: queue "%" is still in use: %. Remove its job types (lockgate undefine) or define them on another queue, let its jobs finish or cancel them, purge or retry its dead letters, remove its recurring tasks and take it out of every running pool first', queue, array_to_string(uses, '; ')
            USING ERRCODE = '55006';
    END IF;
    IF to_regclass(tbl) IS NOT NULL THEN
        PERFORM pgmq.drop_queue(queue);
    END IF;
    FOR step IN SELECT x.prefix, x.args FROM lockgate._steps() x LOOP
        EXECUTE format('DROP FUNCTION IF EXISTS lockgate.%I(%s)', step.prefix || queue, array_to_string(step.args, ', '));
    END LOOP;
    DELETE FROM lockgate.queues q WHERE q.name = drop_queue.queue;
    PERFORM set_config('lock_timeout', caller_lock_timeout, true);
    RETURN true;
END $$;
