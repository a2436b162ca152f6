-- Uniqueness: at most one job per unique key holds its lock (G2, H14). A lock row is owned by
-- one job, (queue, job_id), and released only by that job's own fenced steps, in their
-- transaction: the completion or dead-letter that removed its message (until_executed and
-- while_executing), the retry or shutdown return that ended its run (while_executing), the
-- operator's discard of it while parked; and a while_executing lock whose run lapsed, by the
-- duplicate that takes the key after it (lockgate._take_unique). A stale or duplicate
-- delivery's step matches no message, so it releases nothing, and never a successor's lock: a
-- successor is another job.
-- Lock order: unique lock rows come before semaphore rows in an enqueue; a completion deletes
-- its jobs' lock rows after their leases and promotions (no enqueue waits for a row that a
-- completion deletes while holding a semaphore row the enqueue holds, except an enqueue_many
-- that mixes both kinds of key, whose deadlock PostgreSQL breaks, undoing that call).

-- Takes key for job (queue, job_id) with its current message msg_id (NULL while parked), and
-- returns NULL; or returns the id of the job holding it. The owner taking its own key again (a
-- redelivered while_executing job: the same job on the same message) takes it back; a message
-- that only copies another job's id in its headers is not that job. A lock kept for a cancelled
-- job's handler (held_until, sql/045_cancel.sql) is free once held_until has passed: by then the
-- handler's worker has stopped it (H27). So is a while_executing lock whose holder's delivery
-- has lapsed (its visibility ran out: its worker fenced its handler and a command's watchdog
-- killed its program before then, H27, design §75), which nothing else gives back while the job
-- waits to be delivered again, for good in a queue no one serves (review helper-115 F1); the
-- heartbeat renews no lapsed delivery holding such a key (sql/030_extend.sql); only a claim
-- (mode while_executing) judges that. Never locks a live holder's lock row, nor holds its
-- message, and never waits for either: a producer or claim that meets a duplicate holds nothing
-- that delays its holder's renewal or completion (H28). Waits only for a transaction inserting or
-- deleting the same key.
CREATE OR REPLACE FUNCTION lockgate._take_unique(key text, mode text, job_type text, queue text, job_id bigint, msg_id bigint)
RETURNS bigint LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    taken boolean;
    holder record;
    lapsed boolean;
BEGIN
    LOOP
        INSERT INTO lockgate.unique_locks (key, mode, job_type, queue, job_id, msg_id)
        VALUES (_take_unique.key, _take_unique.mode, _take_unique.job_type, _take_unique.queue, _take_unique.job_id,
                _take_unique.msg_id)
        ON CONFLICT ON CONSTRAINT unique_locks_pkey DO NOTHING
        RETURNING true INTO taken;
        IF taken THEN
            RETURN NULL;
        END IF;
        SELECT u.queue, u.job_id, u.msg_id, u.held_until, u.mode, u.ctid AS tid, u.xmin AS version INTO holder
          FROM lockgate.unique_locks u WHERE u.key = _take_unique.key;
        IF FOUND THEN
            IF holder.held_until <= clock_timestamp() THEN
                -- The cancelled holder's handler has stopped: its lock goes (re-checked under the
                -- row's lock, so a new owner's row is never deleted), and the key is tried again.
                -- But a worker frozen or cut off stopped nothing: its `sql` statement, still running
                -- on a backend that carries its mark, is ended first, and the lock kept if it cannot
                -- be (docs/design.md §100; no new mark can come: the cancel removed the message).
                IF holder.msg_id IS NOT NULL AND cardinality(lockgate._end_statements(
                       ARRAY[lockgate._statement_tag(holder.queue, holder.msg_id)])) > 0 THEN
                    RETURN holder.job_id;
                END IF;
                DELETE FROM lockgate.unique_locks u WHERE u.key = _take_unique.key AND u.held_until <= clock_timestamp();
                CONTINUE;
            END IF;
            IF holder.queue = _take_unique.queue AND holder.job_id = _take_unique.job_id
               AND holder.msg_id IS NOT DISTINCT FROM _take_unique.msg_id THEN
                UPDATE lockgate.unique_locks u SET msg_id = _take_unique.msg_id, acquired_at = now()
                 WHERE u.key = _take_unique.key AND u.queue = _take_unique.queue AND u.job_id = _take_unique.job_id;
                CONTINUE WHEN NOT FOUND;
                RETURN NULL;
            END IF;
            -- A running holder whose delivery lapsed, met by a claim (a while_executing job about
            -- to run; an enqueue or dlq_retry taking an until_executed key that names it reports a
            -- duplicate: its transaction, which may stay open, would hold the lapsed run's row and
            -- with it that run's completion, and every completion batched with it, review
            -- helper-120 F1, H28): judged under its message's row lock, which the heartbeat's
            -- renewal takes too, so a renewal either came first and is seen, or comes after and
            -- finds the delivery lapsed (sql/030_extend.sql, under its own lock). A message another
            -- transaction holds (its completion, a renewal under way) keeps the lock, as does one
            -- gone or in a table that is gone (the reaper's to judge). The row lock is taken in a
            -- subtransaction rolled back at once: held until the claim's commit, it kept a live
            -- holder's renewals busy and its completion waiting (review helper-117 F1, H28). Its
            -- `sql` statement, if its worker is frozen or cut off, is ended first (§100). The lock
            -- row is then deleted as the version read above, by its address and its xmin: the
            -- lapsed job delivered again meanwhile takes its row back on the same message (a new
            -- version, at another address, by another transaction), which the delete then leaves
            -- alone, where a match on its columns deleted the running redelivery's lock (review
            -- helper-120 F2). The xmin is what a delete that waited on that take-back checks again
            -- on the new version: PostgreSQL releases before the fix "Add missing EPQ recheck for
            -- TID Scan" (2025) do not check the address again (review helper-122 F1).
            IF mode = 'while_executing' AND holder.mode = 'while_executing' AND holder.held_until IS NULL
               AND holder.msg_id IS NOT NULL AND holder.queue IN (SELECT lockgate._live_queues()) THEN
                BEGIN
                    EXECUTE format('SELECT m.vt <= clock_timestamp() FROM %s m WHERE m.msg_id = $1 FOR SHARE NOWAIT',
                                   lockgate._queue_table(holder.queue, 'q'))
                       INTO lapsed USING holder.msg_id;
                    RAISE EXCEPTION USING ERRCODE = 'LG900';
                EXCEPTION
                    WHEN lock_not_available THEN
                        lapsed := false;
                    WHEN SQLSTATE 'LG900' THEN
                        NULL;
                END;
                IF lapsed THEN
                    IF cardinality(lockgate._end_statements(
                           ARRAY[lockgate._statement_tag(holder.queue, holder.msg_id)])) > 0 THEN
                        RETURN holder.job_id;
                    END IF;
                    DELETE FROM lockgate.unique_locks u
                     WHERE u.ctid = holder.tid AND u.xmin = holder.version AND u.key = _take_unique.key
                       AND u.queue = holder.queue AND u.job_id = holder.job_id AND u.msg_id = holder.msg_id
                       AND u.held_until IS NULL;
                    CONTINUE;
                END IF;
            END IF;
            RETURN holder.job_id;
        END IF;
        -- Released between the two statements: try again.
    END LOOP;
END $$;

-- Gives back the keys of while_executing runs whose delivery lapsed (their message's visibility
-- passed: no renewal of them lands any more, sql/030_extend.sql), so that a producer naming such
-- a key explicitly, which judges no lapse (§105), is not refused for as long as the lapsed job
-- waits, for good in a paused or unserved queue (review helper-119 F4). What a duplicate's claim
-- does (lockgate._take_unique), in the sweep's short transaction: the holder's message is judged
-- under a share lock and the lock row taken under its own, each skipping a row another
-- transaction holds (a renewal, a claim, a completion under way: looked at again by a later
-- pass); a lapsed run's `sql` statement still running on a marked backend is ended first, and its
-- key kept if it cannot be (§100); the rows, locked here, are deleted by their addresses. The
-- lapsed job, delivered again, takes its key back if it is still free. Found through the partial
-- index of running locks (migration 26): a probe per run under way. Never waits for a lock.
-- Returns how many keys it gave back. Caller: lockgate.sweep.
CREATE OR REPLACE FUNCTION lockgate._release_lapsed_runs()
RETURNS integer LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    q record;
    tids tid[] := '{}';
    tags text[] := '{}';
    found_tids tid[];
    found_tags text[];
    marks text[];
    running text[] := '{}';
    n integer;
BEGIN
    FOR q IN SELECT DISTINCT u.queue FROM lockgate.unique_locks u
              WHERE u.mode = 'while_executing' AND u.held_until IS NULL
                AND u.queue IN (SELECT lockgate._live_queues()) LOOP
        -- SKIP LOCKED skips busy rows, not a table another session locks whole (VACUUM FULL, a
        -- purge, an ALTER TABLE, or one of them waiting behind a long reader) or dropped
        -- meanwhile: such a queue is left for a later pass, so that the sweep, which holds the
        -- rows of its earlier steps, never waits (review helper-123 F1, F2).
        BEGIN
            EXECUTE format('LOCK TABLE %s IN ROW SHARE MODE NOWAIT', lockgate._queue_table(q.queue, 'q'));
        EXCEPTION WHEN lock_not_available OR undefined_table THEN
            CONTINUE;
        END;
        EXECUTE format(
            'SELECT array_agg(x.tid), array_agg(x.tag)
               FROM (SELECT u.ctid AS tid, lockgate._statement_tag(u.queue, u.msg_id) AS tag
                       FROM lockgate.unique_locks u
                       JOIN %s m ON m.msg_id = u.msg_id
                      WHERE u.queue = $1 AND u.mode = ''while_executing'' AND u.held_until IS NULL
                        AND m.vt <= clock_timestamp()
                        FOR UPDATE OF u SKIP LOCKED FOR SHARE OF m SKIP LOCKED) x',
            lockgate._queue_table(q.queue, 'q'))
          INTO found_tids, found_tags USING q.queue;
        tids := tids || COALESCE(found_tids, '{}');
        tags := tags || COALESCE(found_tags, '{}');
    END LOOP;
    IF cardinality(tids) = 0 THEN
        RETURN 0;
    END IF;
    marks := lockgate._statement_marks();
    IF marks && tags THEN
        running := lockgate._end_statements(ARRAY(SELECT t FROM unnest(tags) AS t WHERE t = ANY (marks)));
    END IF;
    DELETE FROM lockgate.unique_locks u
     WHERE u.ctid = ANY (ARRAY(SELECT x.tid FROM unnest(tids, tags) AS x(tid, tag) WHERE NOT x.tag = ANY (running)));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- Releases the locks the given jobs of queue hold through the given messages (job_ids[i] on
-- msg_ids[i], NULL for a parked job; a message that copied another job's id in its headers
-- owns nothing); only
-- while_executing ones when runs_only. Called inside the transaction whose fenced statement
-- ended these jobs or their runs.
CREATE OR REPLACE FUNCTION lockgate._release_unique(queue text, job_ids bigint[], msg_ids bigint[],
                                                    runs_only boolean DEFAULT false)
RETURNS void LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    tids tid[];
BEGIN
    -- Each lock found by a probe of the owner index driven by its job (a lateral subquery no plan
    -- can turn into a walk of the table) and locked there, then deleted by its row address in a
    -- statement of its own (as lockgate._release_leases deletes leases): joined with the jobs, on
    -- the queue as a constant or as a column, a plan made on few or no locks read every lock of
    -- the queue, or every lock, to release one (docs/design.md §60, §65).
    tids := ARRAY(SELECT x.tid FROM unnest(job_ids, msg_ids) AS j(id, msg_id)
                   CROSS JOIN LATERAL (SELECT x.ctid AS tid FROM lockgate.unique_locks x
                                        WHERE x.queue = _release_unique.queue AND x.job_id = j.id
                                          AND x.msg_id IS NOT DISTINCT FROM j.msg_id
                                          AND (NOT runs_only OR x.mode = 'while_executing')
                                       OFFSET 0 FOR UPDATE) x);
    IF cardinality(tids) > 0 THEN
        DELETE FROM lockgate.unique_locks u WHERE u.ctid = ANY (tids);
    END IF;
END $$;

-- Moves the until_executed locks of jobs to their new messages (promotion; NULL when parked
-- again at claim), refreshing acquired_at so a reaper that judged the lock by its old message
-- finds it younger than its age floor and keeps it. Gives back while_executing locks of jobs
-- parked again: they are not running.
CREATE OR REPLACE FUNCTION lockgate._move_unique(queue text, job_ids bigint[], msg_ids bigint[])
RETURNS void LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    tids tid[];
    moved bigint[];
BEGIN
    -- Each lock found by a probe of the owner index driven by its job and locked there, then
    -- written by its row address in a statement of its own (as lockgate._release_leases deletes
    -- leases): joined with the jobs on the queue, a plan made on few locks read every lock of the
    -- queue (docs/design.md §65). moved[i] is the new message of the job whose lock is tids[i].
    SELECT array_agg(x.tid), array_agg(j.msg_id) INTO tids, moved
      FROM unnest(job_ids, msg_ids) AS j(id, msg_id)
     CROSS JOIN LATERAL (SELECT x.ctid AS tid FROM lockgate.unique_locks x
                          WHERE x.queue = _move_unique.queue AND x.job_id = j.id
                            AND (x.mode = 'until_executed' OR j.msg_id IS NULL)
                         OFFSET 0 FOR UPDATE) x;
    IF tids IS NULL THEN
        RETURN;
    END IF;
    UPDATE lockgate.unique_locks u SET msg_id = c.msg_id, acquired_at = now()
      FROM unnest(tids, moved) AS c(tid, msg_id)
     WHERE u.ctid = c.tid AND u.mode = 'until_executed';
    DELETE FROM lockgate.unique_locks u WHERE u.ctid = ANY (tids) AND u.mode = 'while_executing';
END $$;

-- At claim, before a while_executing job runs: takes its unique key (the claim holds its message
-- row). Returns the headers to deliver the job with, or NULL when it is not delivered. When
-- another job holds the key, a type that discards duplicates has the job delivered with
-- duplicate_of (the holder) in its headers (unless the holder was cancelled and its handler may
-- still run: then the job is put back), and its worker completes it without running it (so
-- the claim itself archives nothing and takes no lock of the completion's bookkeeping); a type
-- that rejects them has the job put back for a second to wait for the holder (a return, not an
-- attempt), giving back the concurrency permit it holds (lockgate._yield_permit). Never waits
-- more than a few milliseconds: a key another transaction is inserting or deleting puts the job
-- back too (H28), keeping its permit (that wait is a moment's). A job whose type no longer takes a key while it runs
-- runs without the key when another job holds it.
CREATE OR REPLACE FUNCTION lockgate._start_unique(queue text, c lockgate._claimed)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    tbl text := lockgate._queue_table(queue, 'q');
    job bigint := COALESCE((c.headers->>'job_id')::bigint, c.msg_id);
    saved text := current_setting('lock_timeout');
    holder bigint;
    type_mode text;
    type_on_conflict text;
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', '5ms', true);
        holder := lockgate._take_unique(c.headers->>'wkey', 'while_executing', c.headers->>'type', queue, job, c.msg_id);
        PERFORM set_config('lock_timeout', saved, true);
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', saved, true);
        PERFORM lockgate._put_back(tbl, c);
        RETURN NULL;
    END;
    IF holder IS NULL THEN
        IF c.headers ? 'duplicate_of' THEN
            -- Marked a duplicate by an earlier delivery whose holder has finished since: it runs.
            c.headers := c.headers - 'duplicate_of';
            EXECUTE format('UPDATE %s m SET headers = $3 WHERE m.msg_id = $1 AND m.read_ct = $2', tbl)
              USING c.msg_id, c.read_ct, c.headers;
        END IF;
        RETURN c.headers;
    END IF;
    SELECT t.unique_mode, t.unique_on_conflict INTO type_mode, type_on_conflict
      FROM lockgate.job_types t WHERE t.name = c.headers->>'type';
    -- A type that no longer takes a key while it runs (redefined since the job was enqueued, or
    -- a key written into the headers by hand on a type that never took one) does not wait for
    -- it: the job runs without it, as a type whose limit was removed runs unlimited. Waiting
    -- held the job back, put back every second, for as long as another job held that key, and
    -- for good behind a key nothing gives back (review helper-116 F1).
    IF type_mode IS DISTINCT FROM 'while_executing' THEN
        c.headers := c.headers - 'wkey' - 'duplicate_of';
        EXECUTE format('UPDATE %s m SET headers = $3 WHERE m.msg_id = $1 AND m.read_ct = $2', tbl)
          USING c.msg_id, c.read_ct, c.headers;
        RETURN c.headers;
    END IF;
    -- A holder cancelled while it ran is no duplicate to discard against: it will never finish
    -- as a success. The job waits for its handler to stop, as a rejected one does. So does a
    -- dead letter an operator retried (history_from, sql/050_dlq.sql): asked to run again, it
    -- was archived unrun while another job of its key ran, its dead letter gone (review
    -- helper-115 F3). So does a batch's callback (batch_callback, lockgate._enqueue_callbacks):
    -- another batch's callback of the type running was no reason to run it zero times, its batch
    -- counting it as fired (review helper-131 F2). And so does a job whose key an
    -- until_executed holder has (a job of another type naming the key, or of this type enqueued
    -- before it was redefined from until_executed): that holder may not have run yet, and
    -- discarded against it the job was archived unrun while nothing of its key ran (review
    -- helper-131 F5, H33). Waiting, it runs once the holder's job is terminal. Judged on the key's
    -- lock as it is now, which must be a running while_executing holder's: a holder met above
    -- that has gone since (cancelled, completed) is no run either, and the job is put back, to
    -- run at its next claim (review helper-132 F2: the discard was the default then).
    IF type_on_conflict = 'discard' AND NOT c.headers ? 'history_from' AND NOT c.headers ? 'batch_callback'
       AND EXISTS (SELECT 1 FROM lockgate.unique_locks u
                    WHERE u.key = c.headers->>'wkey' AND u.mode = 'while_executing' AND u.held_until IS NULL) THEN
        c.headers := c.headers || jsonb_build_object('duplicate_of', holder);
        EXECUTE format('UPDATE %s m SET headers = $3 WHERE m.msg_id = $1 AND m.read_ct = $2', tbl)
          USING c.msg_id, c.read_ct, c.headers;
        RETURN c.headers;
    END IF;
    -- Waiting, it holds no concurrency permit: the holder may be parked for it (review helper-132
    -- F1, lockgate._yield_permit).
    PERFORM lockgate._put_back(tbl, c);
    IF c.headers ? 'ckey' THEN
        PERFORM lockgate._yield_permit(queue, c.msg_id);
    END IF;
    RETURN NULL;
END $$;

-- The reaper (dispatcher): deletes locks whose job no longer exists — no message of its queue
-- with the lock's msg_id or the job's id, no parked job with its id — such as a job deleted
-- outside lockgate (pgmq.delete, pgmq.archive). Only locks older than min_age, so a lock is
-- never judged before the transaction that took it has long committed; and since every step
-- that moves a job to a new message refreshes its lock's acquired_at in the same transaction,
-- a lock judged by a message it no longer names is kept. A cancelled job's lock (its message
-- archived by the cancel) is judged by its held_until alone: it goes once that has passed, and
-- never before, however old (a long run's lock is as old as the run); its `sql` statement, if
-- one still runs on a marked backend, is ended first, and the lock kept if it cannot be (§100). A lock of a queue whose table is gone
-- cannot be judged, and is kept. One statement per queue, skipping rows other transactions
-- hold. Returns how many locks it deleted.
-- Locks: unique lock rows (SKIP LOCKED). Callers: the maintenance service, operators.
CREATE OR REPLACE FUNCTION lockgate.reap_unique_locks(min_age interval DEFAULT '10 minutes', max_rows integer DEFAULT 1000)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    q record;
    n integer;
    reaped integer := 0;
    -- The marks of cancelled holders' statements that could not be ended (docs/design.md §100).
    kept text[] := '{}';
BEGIN
    IF min_age < interval '0' OR max_rows < 0 THEN
        RAISE EXCEPTION 'lockgate: min_age and max_rows must not be negative (got %, %)', min_age, max_rows
            USING ERRCODE = 'LG003';
    END IF;
    IF EXISTS (SELECT 1 FROM lockgate.unique_locks u WHERE u.held_until < now() AND u.msg_id IS NOT NULL) THEN
        kept := lockgate._end_statements(ARRAY(
            SELECT lockgate._statement_tag(u.queue, u.msg_id) FROM lockgate.unique_locks u
             WHERE u.held_until < now() AND u.msg_id IS NOT NULL));
    END IF;
    FOR q IN SELECT DISTINCT u.queue FROM lockgate.unique_locks u
              WHERE ((u.held_until IS NULL AND u.acquired_at < now() - min_age) OR u.held_until < now())
                AND u.queue IN (SELECT lockgate._live_queues())
              ORDER BY u.queue LOOP
        EXECUTE format(
            'WITH doomed AS (
                 SELECT u.key FROM lockgate.unique_locks u
                  WHERE u.queue = $1 AND ((u.held_until IS NULL AND u.acquired_at < now() - $2) OR u.held_until < now())
                    AND NOT EXISTS (SELECT 1 FROM %1$s m WHERE m.msg_id = u.msg_id)
                    AND NOT EXISTS (SELECT 1 FROM %1$s m WHERE m.msg_id = u.job_id)
                    AND NOT EXISTS (SELECT 1 FROM lockgate.parked p WHERE p.job_id = u.job_id)
                    AND NOT (u.held_until IS NOT NULL AND lockgate._statement_tag(u.queue, u.msg_id) = ANY ($4))
                  ORDER BY u.key LIMIT $3
                    FOR UPDATE OF u SKIP LOCKED),
             gone AS (DELETE FROM lockgate.unique_locks u USING doomed d WHERE u.key = d.key RETURNING 1)
             SELECT count(*) FROM gone',
            lockgate._queue_table(q.queue, 'q'))
          INTO n USING q.queue, min_age, max_rows, kept;
        reaped := reaped + n;
    END LOOP;
    RETURN reaped;
END $$;

-- The locks held now, for operators: key, mode, type, owner and since when.
-- Locks: none. Callers: lockgate status, SQL operators.
CREATE OR REPLACE FUNCTION lockgate.unique_lock_stats()
RETURNS TABLE (job_type text, mode text, held bigint, oldest_seconds double precision)
LANGUAGE sql STABLE AS $$
    SELECT u.job_type, u.mode, count(*), extract(epoch FROM now() - min(u.acquired_at))::double precision
      FROM lockgate.unique_locks u GROUP BY u.job_type, u.mode ORDER BY u.job_type, u.mode
$$;

-- The job id in headers, when they carry a well-formed one (a job sent again as a new message);
-- NULL otherwise (a job on its first message: its id is its msg_id).
CREATE OR REPLACE FUNCTION lockgate._job_id_of(headers jsonb)
RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(headers) = 'object' AND headers->>'job_id' ~ '^[1-9][0-9]{0,17}$'
                THEN (headers->>'job_id')::bigint END
$$;
