-- Batches (G2, H22): a job enqueued into a batch has a membership row (lockgate.batch_jobs,
-- keyed by the job) and carries the batch's id in its headers ("batch", which only tells the
-- completion to look for the membership). succeeded grows in the completion that archived a
-- job, failed in the dead-letter that removed one (or the cancel or discard of a parked one),
-- each gated by its fenced statement and by deleting the job's membership, so a duplicate
-- delivery, a retry or a message that merely carries a batch header counts nothing more. A
-- batch's total is succeeded + failed + its memberships, fixed (written to total) when it
-- finishes.
-- A closed batch finishes when it has no membership left and no enqueue is still adding to it;
-- the transaction that sees that, under the batch row's lock, finishes it: a completion or
-- dead letter counting its last job, the close itself, or the batch sweep. Counting, closing
-- and finishing lock the batch row FOR NO KEY UPDATE, in a statement of their own before they
-- read anything, so each reads what the one before it committed: of two last completions
-- racing on two connections exactly one sees nothing left (H22).
-- An enqueue never updates the batch row: it holds it FOR KEY SHARE (checking that it is open,
-- and again through each membership's foreign key) until its commit. That share conflicts with
-- none of the locks above, so a producer transaction adding jobs of limited keys to a batch,
-- statement after statement, never waits for a completion that counts the batch while holding
-- a semaphore row the producer needs next, nor the other way round, and a close never waits for
-- a producer (H31). Only finishing needs the share gone: it takes the row FOR UPDATE SKIP
-- LOCKED, and while an enqueue holds the share it leaves the batch closed; that enqueue's jobs
-- finish it, or, when it added none, the batch sweep does.
-- A count (a completion's, a dead letter's, a cancel's) waits at most 300 ms for the batch row
-- another transaction holds: then it writes the job's outcome on its membership, and the
-- next holder of the row moves it onto the row (lockgate._count_batch_jobs, _fold_outcomes;
-- docs/design.md §73). Readers add such outcomes to the row's counts (lockgate._waiting_outcomes).
-- Callbacks are enqueued in the finishing transaction when their types take no lock (no limit,
-- no uniqueness: the enqueue only inserts a message); otherwise by the batch sweep, at most a
-- sweep interval later, so a completion never waits for or deadlocks on a callback's keys.
-- Lock order: a batch row is counted after every other row its transaction locks (messages,
-- leases, semaphores, unique locks, batch memberships); batches in id order.

-- Validates a callback job type: NULL (none) or a defined type, whose row it holds FOR KEY SHARE
-- until the caller's commit, so that lockgate.remove_job_type (which takes the row FOR UPDATE,
-- then counts the batches naming it) either counts the new batch or has removed the type before
-- this looks (design §91).
CREATE OR REPLACE FUNCTION lockgate._check_callback(which text, job_type text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF job_type IS NULL THEN
        RETURN;
    END IF;
    PERFORM 1 FROM lockgate.job_types t WHERE t.name = job_type FOR KEY SHARE;
    IF NOT FOUND THEN
        -- Looked for again by a new statement: a type removed and defined again in one transaction
        -- while this waited is another row, which the wait does not follow (review helper-96).
        PERFORM 1 FROM lockgate.job_types t WHERE t.name = job_type FOR KEY SHARE;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lockgate: unknown job type "%" for the batch callback %', job_type, which
            USING ERRCODE = 'LG002', HINT = 'define it with lockgate.define_job_type or in lockgate.toml first';
    END IF;
END $$;

-- A new, open batch. Callbacks are job types: on_finish runs when every job is counted,
-- on_success when none failed, on_failure when some did; each gets the arguments
-- {"batch_id", "total", "succeeded", "failed", "properties"}.
-- SECURITY DEFINER, as lockgate.enqueue (010_enqueue.sql, "Privileges").
-- Locks: the callback types' rows (FOR KEY SHARE). Callers: Client::create_batch, the CLI, SQL
-- producers.
CREATE OR REPLACE FUNCTION lockgate.create_batch(on_finish text DEFAULT NULL, on_success text DEFAULT NULL,
                                                 on_failure text DEFAULT NULL, properties jsonb DEFAULT '{}')
RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    id bigint;
    size integer;
BEGIN
    PERFORM lockgate._check_callback('on_finish', on_finish);
    PERFORM lockgate._check_callback('on_success', on_success);
    PERFORM lockgate._check_callback('on_failure', on_failure);
    IF properties IS NULL OR jsonb_typeof(properties) <> 'object' THEN
        RAISE EXCEPTION 'lockgate: batch properties must be a JSON object, got %', COALESCE(jsonb_typeof(properties), 'null')
            USING ERRCODE = 'LG003';
    END IF;
    -- The callbacks' arguments carry them, and arguments are at most 1 MiB. Measured as they
    -- will be, inside a new object: a value read from a table may be compressed, and its own
    -- size then says nothing of the arguments' (review helper-101: 3 MB of properties passed
    -- as 34 kB, and every callback was refused for good).
    size := pg_column_size(jsonb_build_object('properties', properties));
    IF size > 1000000 THEN
        RAISE EXCEPTION 'lockgate: batch properties are % bytes, more than the 1000000 allowed', size
            USING ERRCODE = 'LG003';
    END IF;
    INSERT INTO lockgate.batches (on_finish, on_success, on_failure, properties)
    VALUES (create_batch.on_finish, create_batch.on_success, create_batch.on_failure, create_batch.properties)
    RETURNING batches.id INTO id;
    RETURN id;
END $$;

-- Holds the batch row FOR KEY SHARE until the enqueue's commit, raising naming the batch when
-- it does not exist or is not open (nothing of the enqueue is kept). Taken before the enqueue
-- locks anything else: a close in progress makes it wait, then raise.
CREATE OR REPLACE FUNCTION lockgate._join_batch(batch bigint)
RETURNS void LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    st text;
BEGIN
    SELECT b.state INTO st FROM lockgate.batches b WHERE b.id = batch FOR KEY SHARE;
    IF st IS DISTINCT FROM 'open' THEN
        RAISE EXCEPTION 'lockgate: %', CASE WHEN st IS NULL THEN format('batch %s does not exist', batch)
                                            ELSE format('batch %s is %s: no job can be added to it', batch, st) END
            USING ERRCODE = 'LG003';
    END IF;
END $$;

-- Closes an open batch: no job can be added any more, and it finishes when its last job is
-- counted (at once if none is pending and no enqueue is still adding to it). Raises for an
-- unknown batch or one already closed. Returns its state after closing ('closed' or 'finished').
-- An enqueue that began adding to the batch before the close committed still adds its jobs.
-- Locks: the batch row FOR NO KEY UPDATE (it waits for a counting completion, never for an
-- enqueue). SECURITY DEFINER, as lockgate.enqueue. Callers: Client::close_batch, the CLI, SQL
-- producers.
CREATE OR REPLACE FUNCTION lockgate.close_batch(batch_id bigint)
RETURNS text LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET enable_seqscan = off SET jit = off AS $$
DECLARE
    st text;
BEGIN
    IF batch_id IS NULL THEN
        RAISE EXCEPTION 'lockgate: the batch id is NULL' USING ERRCODE = 'LG003';
    END IF;
    UPDATE lockgate.batches x SET state = 'closed', closed_at = now(), updated_at = now()
     WHERE x.id = batch_id AND x.state = 'open'
    RETURNING x.state INTO st;
    IF NOT FOUND THEN
        SELECT x.state INTO st FROM lockgate.batches x WHERE x.id = batch_id;
        RAISE EXCEPTION 'lockgate: %', CASE WHEN st IS NULL THEN format('batch %s does not exist', batch_id)
                                            ELSE format('batch %s is already %s', batch_id, st) END
            USING ERRCODE = 'LG003';
    END IF;
    IF lockgate._finish_if_done(batch_id) THEN
        RETURN 'finished';
    END IF;
    RETURN 'closed';
END $$;

-- A batch's total: fixed once it is finished; before, the jobs counted so far and its
-- memberships (jobs not counted yet) as the caller's snapshot sees them.
CREATE OR REPLACE FUNCTION lockgate._batch_total(b lockgate.batches)
RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN b.state = 'finished' THEN b.total
                ELSE b.succeeded + b.failed + (SELECT count(*) FROM lockgate.batch_jobs m WHERE m.batch_id = b.id) END
$$;

-- Finishes a closed batch that has no membership left and no enqueue adding to it; whether it
-- did. The caller holds the batch row FOR NO KEY UPDATE, taken in an earlier statement, so the
-- memberships read here are those committed by whoever held it before. An enqueue still adding
-- to the batch holds the row FOR KEY SHARE: the FOR UPDATE SKIP LOCKED then finds nothing and
-- the batch stays closed, for that enqueue's jobs (or the batch sweep) to finish. Once taken,
-- FOR UPDATE keeps any new enqueue out until the finish commits (it then finds the batch
-- finished), and the memberships are read once more: an enqueue that committed between the
-- first read and the lock is seen there. A transaction waiting for the row makes SKIP LOCKED
-- find nothing too: that transaction counts, closes or sweeps the batch next, and checks again.
CREATE OR REPLACE FUNCTION lockgate._finish_if_done(batch_id bigint)
RETURNS boolean LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
BEGIN
    -- The reads after the locks must see what committed before them: a repeatable read or
    -- serializable transaction reads its first statement's snapshot, and would miss a producer
    -- that committed since. It leaves the finish to a later count or the batch sweep.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN false;
    END IF;
    -- Jobs whose count waited on their memberships are counted now (the caller holds the row).
    PERFORM lockgate._fold_outcomes(ARRAY[batch_id]);
    IF EXISTS (SELECT 1 FROM lockgate.batch_jobs m WHERE m.batch_id = _finish_if_done.batch_id) THEN
        RETURN false;
    END IF;
    PERFORM 1 FROM lockgate.batches x WHERE x.id = batch_id AND x.state = 'closed' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    -- Again, now that no enqueue can share the row: one that committed between the first read
    -- and the lock left memberships the first read could not see.
    IF EXISTS (SELECT 1 FROM lockgate.batch_jobs m WHERE m.batch_id = _finish_if_done.batch_id) THEN
        RETURN false;
    END IF;
    PERFORM lockgate._finish_batch(batch_id);
    RETURN true;
END $$;

-- Counts finished jobs of batches (one element per job; as_failed tells how): the batch rows
-- locked first, in id order, in a statement of their own (an UPDATE that locks its rows in a
-- subquery deadlocks with another such UPDATE while an enqueue shares the row), then counted;
-- closed batches with nothing left are finished here. Called inside the transaction whose
-- fenced statement ended these jobs. Ids that name no batch (removed by hand) are ignored.
CREATE OR REPLACE FUNCTION lockgate._count_batches(batch_ids bigint[], as_failed boolean)
RETURNS void LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    closed bigint;
    ids bigint[];
    counts integer[];
BEGIN
    SELECT array_agg(x.id ORDER BY x.id), array_agg(x.n ORDER BY x.id) INTO ids, counts
      FROM (SELECT u.id, count(*)::integer AS n FROM unnest(batch_ids) AS u(id) GROUP BY u.id) x;
    -- Each row locked by a probe of its own, in id order; then updated by its primary key, the ids
    -- an array the index searches, with no join: a plan made on few batches read them all, twice,
    -- for every job counted (docs/design.md §65).
    PERFORM 1 FROM unnest(ids) AS k(id)
     CROSS JOIN LATERAL (SELECT FROM lockgate.batches y WHERE y.id = k.id OFFSET 0 FOR NO KEY UPDATE) y;
    PERFORM lockgate._fold_outcomes(ids);
    FOR closed IN
        WITH counted AS (
            UPDATE lockgate.batches b
               SET succeeded = b.succeeded + CASE WHEN as_failed THEN 0 ELSE counts[array_position(ids, b.id)] END,
                   failed = b.failed + CASE WHEN as_failed THEN counts[array_position(ids, b.id)] ELSE 0 END,
                   updated_at = now()
             WHERE b.id = ANY (ids)
            RETURNING b.id, b.state)
        SELECT c.id FROM counted c WHERE c.state = 'closed' ORDER BY c.id
    LOOP
        PERFORM lockgate._finish_if_done(closed);
    END LOOP;
END $$;

-- Counts the given jobs of queue that are members of a batch (deleting their memberships), as
-- failed or succeeded; a job that is no member (never added, or counted already) counts nothing.
-- Waits at most 300 ms in all (less within a caller's shorter lock_timeout, or half its
-- statement_timeout from the statement's start) for the batch rows that another transaction
-- holds (a producer that closed the batch in a transaction still open; a wait that outlasted the
-- job's lease made the finished job run again): each row is taken if free
-- (lockgate._take_batches), a held one waited for, and the jobs of a batch still held after that
-- keep their memberships with their outcome written on them, for the next holder of the row to
-- count (lockgate._fold_outcomes; docs/design.md §73).
-- msg_ids[i], when given, is the message job_ids[i] was on (a completion, a dead letter, a cancel
-- of a queued or running job): only a membership naming that message counts (or one written
-- before migration 28, which names none), so a message written outside lockgate that copies a
-- batched job's id counts nothing, nor does a parked job's (its membership names no message until
-- its promotion writes one in; design §111, review helper-131 F1). NULL for a parked job's own
-- paths (its cancel, its dead letter), which count it by its parked row.
CREATE OR REPLACE FUNCTION lockgate._count_batch_jobs(queue text, job_ids bigint[], as_failed boolean, msg_ids bigint[])
RETURNS void LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    tids tid[];
    bids bigint[];
    ids bigint[];
    take boolean[];
    held bigint[];
    kept tid[];
    saved text := current_setting('lock_timeout');
    -- When waiting ends, for every row together: 300 ms from now, sooner when the caller allows
    -- less (its own lock_timeout from now, or half its statement_timeout from the statement's
    -- start: a wait that outlasted the statement failed the completion).
    deadline timestamptz := LEAST(clock_timestamp() + interval '300 ms',
                                  clock_timestamp() + NULLIF(saved::interval, interval '0'),
                                  statement_timestamp()
                                      + NULLIF(current_setting('statement_timeout')::interval, interval '0') / 2);
    left_ms bigint;
    counted bigint[];
BEGIN
    -- Each membership found by a probe of the primary key driven by its job and locked there, as
    -- lockgate._release_unique does (docs/design.md §65); one already counted is no member.
    SELECT array_agg(x.tid), array_agg(x.batch_id) INTO tids, bids
      FROM unnest(job_ids, msg_ids) AS j(id, msg_id)
     CROSS JOIN LATERAL (SELECT x.ctid AS tid, x.batch_id FROM lockgate.batch_jobs x
                          WHERE x.queue = _count_batch_jobs.queue AND x.job_id = j.id AND x.outcome IS NULL
                            AND (j.msg_id IS NULL OR x.msg_id IS NULL OR x.msg_id = j.msg_id)
                         OFFSET 0 FOR UPDATE) x;
    IF tids IS NULL THEN
        RETURN;
    END IF;
    ids := ARRAY(SELECT DISTINCT b.id FROM unnest(bids) AS b(id) ORDER BY b.id);
    take := lockgate._take_batches(ids);
    IF array_position(take, NULL) IS NOT NULL THEN
        -- Held: most often by another count of the batch, which holds the row until its commit,
        -- a few milliseconds. Each held row is waited for in id order until the deadline (300 ms
        -- at most, below PostgreSQL's default deadlock_timeout), in a subtransaction of its own
        -- that gives back nothing but that wait if it ends; the rows still held then wait on
        -- their memberships. Waiting only a few milliseconds, the last two counts of a batch raced
        -- past each other and left its finish to the batch sweep (review of §73).
        FOR i IN 1 .. cardinality(ids) LOOP
            CONTINUE WHEN take[i] IS NOT NULL;
            left_ms := floor(extract(epoch FROM deadline - clock_timestamp()) * 1000);
            EXIT WHEN left_ms < 1;
            BEGIN
                PERFORM set_config('lock_timeout', left_ms || 'ms', true);
                PERFORM FROM lockgate.batches y WHERE y.id = ids[i] FOR NO KEY UPDATE;
                take[i] := FOUND;
                PERFORM set_config('lock_timeout', saved, true);
            EXCEPTION WHEN lock_not_available OR deadlock_detected OR serialization_failure THEN
                PERFORM set_config('lock_timeout', saved, true);
            END;
        END LOOP;
    END IF;
    IF array_position(take, NULL) IS NOT NULL THEN
        held := ARRAY(SELECT k.id FROM unnest(ids, take) AS k(id, t) WHERE k.t IS NULL);
        SELECT array_agg(m.tid) FILTER (WHERE m.batch_id = ANY (held)),
               array_agg(m.tid) FILTER (WHERE NOT m.batch_id = ANY (held))
          INTO kept, tids
          FROM unnest(tids, bids) AS m(tid, batch_id);
        UPDATE lockgate.batch_jobs m SET outcome = CASE WHEN as_failed THEN 'failed' ELSE 'succeeded' END
         WHERE m.ctid = ANY (kept);
    END IF;
    WITH gone AS (DELETE FROM lockgate.batch_jobs m WHERE m.ctid = ANY (tids) RETURNING m.batch_id)
    SELECT array_agg(gone.batch_id) INTO counted FROM gone;
    IF cardinality(counted) > 0 THEN
        PERFORM lockgate._count_batches(counted, as_failed);
    END IF;
END $$;

-- Revision 116's form, which matched a job on its id alone: kept for the sessions that still run
-- that revision's functions while a migrate replaces them (a completion that began before the
-- migrate's commit calls it after), counting as it did. A later revision drops it.
CREATE OR REPLACE FUNCTION lockgate._count_batch_jobs(queue text, job_ids bigint[], as_failed boolean)
RETURNS void LANGUAGE sql AS $$
    SELECT lockgate._count_batch_jobs(queue, job_ids, as_failed, NULL::bigint[])
$$;

-- Locks the rows of batches (distinct, sorted), each by a probe of its own in their order,
-- FOR NO KEY UPDATE as counting does, skipping any row another transaction holds: never waits.
-- Returns, for each id in order, true when its row is locked here, false when it has no row,
-- NULL when another transaction holds it. Callers: lockgate._count_batch_jobs.
CREATE OR REPLACE FUNCTION lockgate._take_batches(ids bigint[])
RETURNS boolean[] LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
BEGIN
    RETURN ARRAY(
        SELECT CASE WHEN m.locked THEN true WHEN p.present IS NULL THEN false END
          FROM unnest(ids) WITH ORDINALITY AS g(id, o)
          LEFT JOIN LATERAL (SELECT true AS locked FROM lockgate.batches x WHERE x.id = g.id
                              OFFSET 0 FOR NO KEY UPDATE SKIP LOCKED) m ON true
          LEFT JOIN LATERAL (SELECT true AS present FROM lockgate.batches x WHERE x.id = g.id AND m.locked IS NULL
                              OFFSET 0) p ON true
         ORDER BY g.o);
END $$;

-- Counts the jobs of the given batches whose outcome waited on their memberships
-- (lockgate._count_batch_jobs), deleting those memberships; the caller holds the batches' rows.
-- One probe of an index that is empty but for the moment such a membership exists; a membership
-- whose completion has not committed yet is skipped, for a later holder.
CREATE OR REPLACE FUNCTION lockgate._fold_outcomes(ids bigint[])
RETURNS void LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM lockgate.batch_jobs m WHERE m.outcome IS NOT NULL) THEN
        RETURN;
    END IF;
    WITH gone AS (
        DELETE FROM lockgate.batch_jobs m
         WHERE m.ctid = ANY (ARRAY(SELECT x.ctid FROM lockgate.batch_jobs x
                                    WHERE x.batch_id = ANY (ids) AND x.outcome IS NOT NULL
                                      FOR UPDATE SKIP LOCKED))
        RETURNING m.batch_id, m.outcome),
    c AS (
        SELECT g.batch_id, count(*) FILTER (WHERE g.outcome = 'succeeded') AS s,
               count(*) FILTER (WHERE g.outcome = 'failed') AS f
          FROM gone g GROUP BY g.batch_id)
    UPDATE lockgate.batches b SET succeeded = b.succeeded + c.s, failed = b.failed + c.f, updated_at = now()
      FROM c WHERE b.id = c.batch_id;
END $$;

-- Deletes the memberships of the given jobs of queue; returns their batches' ids, one element
-- per membership deleted (empty when none).
CREATE OR REPLACE FUNCTION lockgate._drop_memberships(queue text, job_ids bigint[])
RETURNS bigint[] LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    tids tid[];
    batch_ids bigint[];
BEGIN
    -- Each membership found by a probe of the primary key driven by its job and locked there,
    -- then deleted by its row address, as lockgate._release_unique does (docs/design.md §65).
    tids := ARRAY(SELECT x.tid FROM unnest(job_ids) AS j(id)
                   CROSS JOIN LATERAL (SELECT x.ctid AS tid FROM lockgate.batch_jobs x
                                        WHERE x.queue = _drop_memberships.queue AND x.job_id = j.id
                                       OFFSET 0 FOR UPDATE) x);
    IF cardinality(tids) = 0 THEN
        RETURN '{}';
    END IF;
    WITH gone AS (DELETE FROM lockgate.batch_jobs m WHERE m.ctid = ANY (tids) RETURNING m.batch_id)
    SELECT array_agg(gone.batch_id) INTO batch_ids FROM gone;
    RETURN COALESCE(batch_ids, '{}');
END $$;

-- Finishes a closed batch whose jobs are all counted (the caller holds its row lock): marks it
-- finished with its total fixed and its callbacks pending, and enqueues them at once when none of their types takes
-- a lock (no limit, no uniqueness). The others are left to the sweep (lockgate.batch_sweep), so
-- a completion never waits for a callback's keys nor deadlocks on them; nor does a callback
-- that cannot be enqueued fail the completion. Each callback is enqueued once: the state moves
-- to finished in this transaction, and callbacks are enqueued only while callbacks_pending is
-- set, clearing it in the same transaction.
CREATE OR REPLACE FUNCTION lockgate._finish_batch(batch_id bigint)
RETURNS void LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    b lockgate.batches;
BEGIN
    UPDATE lockgate.batches x SET state = 'finished', finished_at = now(), updated_at = now(), callbacks_pending = true,
                                  total = x.succeeded + x.failed
     WHERE x.id = batch_id AND x.state = 'closed'
    RETURNING x.* INTO b;
    IF FOUND AND NOT EXISTS (
        SELECT 1 FROM unnest(ARRAY[b.on_finish,
                                   CASE WHEN b.failed = 0 THEN b.on_success END,
                                   CASE WHEN b.failed > 0 THEN b.on_failure END]) AS c(name)
          LEFT JOIN lockgate.job_types t ON t.name = c.name
         WHERE c.name IS NOT NULL AND (t.name IS NULL OR t.concurrency_limit IS NOT NULL OR t.unique_mode IS NOT NULL)) THEN
        PERFORM lockgate._enqueue_callbacks(b);
    END IF;
END $$;

-- Enqueues a finished batch's callbacks and clears callbacks_pending, or records why it could
-- not (all of them or none: a subtransaction). A callback that is not stored — parked counts as
-- stored, but not discarded by its limit nor a duplicate of its unique key — counts as not
-- enqueued: the batch stays pending, with the reason. Each job's arguments say which callback
-- it is (callback: finish, success or failure): one type named for two of them got two jobs it
-- could not tell apart (review helper-92), and, with a unique key of its whole arguments, the
-- second was a duplicate of the first and the batch stayed pending.
-- One type named for two callbacks whose own policy refuses the second behind the first (a
-- unique key without the callback in it; a limit whose on_conflict is discard or raise, the
-- first holding the permit) could never be enqueued both at once: every pass rolled both back,
-- and the batch stayed pending for good, naming a job that never existed (review helper-98).
-- Such a callback counts as merged into the first when what refused it is that callback alone:
-- the holder of its unique key is a job stored earlier in this pass, or its concurrency key is
-- full with leases of such jobs alone. The type's own policy then allows one job where two were
-- named; the job's arguments name the first callback. Refused by anything else (another job
-- holding the key or a permit of it), the pass rolls back and stays pending, as any refusal does
-- (review helper-101: merged on the type alone, a callback refused by an unrelated job was lost).
CREATE OR REPLACE FUNCTION lockgate._enqueue_callbacks(b lockgate.batches)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    args jsonb := jsonb_build_object('batch_id', b.id, 'total', b.total, 'succeeded', b.succeeded, 'failed', b.failed,
                                     'properties', b.properties);
    c record;
    r record;
    jt lockgate.job_types;
    cargs jsonb;
    refusal text;
    -- The refusal raised by the enqueue (LG004, LG005), kept to be raised again as it was.
    raised_message text;
    raised_state text;
    -- The callbacks stored in this pass: their job ids, and their messages (queue, msg_id).
    stored_jobs bigint[] := '{}';
    stored_msgs text[] := '{}';
BEGIN
    BEGIN
        FOR c IN SELECT * FROM (VALUES (1, 'finish', b.on_finish),
                                       (2, 'success', CASE WHEN b.failed = 0 THEN b.on_success END),
                                       (3, 'failure', CASE WHEN b.failed > 0 THEN b.on_failure END)) v(n, kind, job_type)
                  WHERE v.job_type IS NOT NULL ORDER BY v.n LOOP
            cargs := args || jsonb_build_object('callback', c.kind);
            raised_state := NULL;
            BEGIN
                SELECT * INTO r FROM lockgate.enqueue(c.job_type, cargs);
                IF r.status IN ('enqueued', 'parked') THEN
                    stored_jobs := stored_jobs || r.job_id;
                    -- A callback of a type that discards while_executing duplicates is marked,
                    -- so that its claim waits for another job of its key, never discards it
                    -- (lockgate._start_unique; review helper-131 F2): a discard at the claim
                    -- would run it zero times, its batch counting it as fired.
                    IF (SELECT t.unique_mode FROM lockgate.job_types t WHERE t.name = c.job_type) = 'while_executing' THEN
                        IF r.msg_id IS NULL THEN
                            UPDATE lockgate.parked p SET headers = p.headers || '{"batch_callback": true}'
                             WHERE p.job_id = r.job_id;
                        ELSE
                            EXECUTE format('UPDATE %s m SET headers = m.headers || ''{"batch_callback": true}'' WHERE m.msg_id = $1',
                                           lockgate._queue_table(r.queue, 'q'))
                              USING r.msg_id;
                        END IF;
                    END IF;
                    -- A parked job has no message yet, nor a lease.
                    IF r.msg_id IS NOT NULL THEN
                        stored_msgs := stored_msgs || (r.queue || ':' || r.msg_id);
                    END IF;
                    CONTINUE;
                END IF;
                refusal := CASE r.status WHEN 'duplicate' THEN 'unique' WHEN 'discarded' THEN 'limit' END;
            EXCEPTION WHEN SQLSTATE 'LG004' OR SQLSTATE 'LG005' THEN
                -- Refused by its limit (raise) or its unique key (reject): this subtransaction
                -- alone is undone.
                IF cardinality(stored_jobs) = 0 THEN
                    RAISE;
                END IF;
                refusal := CASE SQLSTATE WHEN 'LG005' THEN 'unique' ELSE 'limit' END;
                raised_message := SQLERRM;
                raised_state := SQLSTATE;
            END;
            SELECT * INTO jt FROM lockgate.job_types t WHERE t.name = c.job_type;
            CONTINUE WHEN refusal = 'unique' AND (
                SELECT u.job_id = ANY (stored_jobs) FROM lockgate.unique_locks u
                 WHERE u.key = lockgate._unique_key(jt, cargs, NULL));
            -- Full, and of this pass's callbacks alone: a lease of another job, even one that has
            -- ended since the refusal, leaves the pass to be tried again.
            CONTINUE WHEN refusal = 'limit' AND (
                SELECT count(*) >= jt.concurrency_limit AND bool_and(l.queue || ':' || l.msg_id = ANY (stored_msgs))
                  FROM lockgate.leases l
                 WHERE l.key = lockgate._concurrency_key(jt, cargs, NULL));
            IF raised_state IS NOT NULL THEN
                RAISE EXCEPTION USING MESSAGE = raised_message, ERRCODE = raised_state;
            END IF;
            -- Named by what refused it: a discarded enqueue's job id was drawn for a job never
            -- stored (review helper-115 F2).
            IF refusal = 'unique' THEN
                RAISE EXCEPTION 'lockgate: callback % was refused: job % holds its unique key', c.job_type, r.job_id;
            END IF;
            RAISE EXCEPTION 'lockgate: callback % was discarded: its concurrency key "%" is full', c.job_type,
                lockgate._concurrency_key(jt, cargs, NULL);
        END LOOP;
        UPDATE lockgate.batches x SET callbacks_pending = false, callback_error = NULL WHERE x.id = b.id;
    EXCEPTION WHEN OTHERS THEN
        -- updated_at moves with the error, so that the sweep tries the batches it has not tried
        -- for the longest first.
        UPDATE lockgate.batches x SET callback_error = left(SQLERRM, 4000), updated_at = now() WHERE x.id = b.id;
    END;
END $$;

-- The batch sweep (dispatcher): finishes closed batches with nothing left that no completion
-- finished (an enqueue was still adding to the batch when its last job was counted, and added
-- nothing, or rolled back), and enqueues the callbacks of finished batches whose callbacks were
-- not enqueued when they finished (types that take locks, or an enqueue that failed). Never
-- waits long: a callback's key held by another transaction makes the enqueue give up after
-- 100 ms (lock_timeout, set for this call only: the caller's transaction keeps its own), and
-- the batch stays pending for the next pass. Returns how many batches it finished or completed
-- the callbacks of, each once.
-- Locks: batch rows (SKIP LOCKED), then what the callbacks' enqueues lock.
-- Callers: the bookkeeping sweep service, operators.
CREATE OR REPLACE FUNCTION lockgate.batch_sweep(max_rows integer DEFAULT 100)
RETURNS integer LANGUAGE plpgsql SET lock_timeout = '100ms' AS $$
DECLARE
    b lockgate.batches;
    done bigint;
    repaired bigint[] := '{}';
BEGIN
    IF max_rows < 0 THEN
        RAISE EXCEPTION 'lockgate: max_rows must not be negative (got %)', max_rows USING ERRCODE = 'LG003';
    END IF;
    -- FOR UPDATE SKIP LOCKED: a batch an enqueue still shares is passed over here, not taken
    -- into the LIMIT (a producer adding to many batches would otherwise fill it).
    FOR done IN SELECT x.id FROM lockgate.batches x
                 WHERE x.state = 'closed'
                   AND NOT EXISTS (SELECT 1 FROM lockgate.batch_jobs m WHERE m.batch_id = x.id AND m.outcome IS NULL)
                 ORDER BY x.id LIMIT max_rows FOR UPDATE SKIP LOCKED LOOP
        IF lockgate._finish_if_done(done) THEN
            repaired := repaired || done;
        END IF;
    END LOOP;
    -- Those tried longest ago first: ordered by id, batches whose callbacks keep failing filled
    -- every pass, and a newer batch beyond them never had its turn (review helper-101).
    FOR b IN SELECT * FROM lockgate.batches x WHERE x.callbacks_pending AND x.state = 'finished'
              ORDER BY x.updated_at, x.id LIMIT max_rows FOR NO KEY UPDATE SKIP LOCKED LOOP
        PERFORM lockgate._enqueue_callbacks(b);
        IF NOT (SELECT x.callbacks_pending FROM lockgate.batches x WHERE x.id = b.id) THEN
            repaired := repaired || b.id;
        END IF;
    END LOOP;
    -- A batch this pass finished and then completed the callbacks of counts once (review
    -- helper-101).
    RETURN (SELECT count(DISTINCT r) FROM unnest(repaired) r);
END $$;

-- The batch reaper (dispatcher): counts as failed the members of closed batches idle for
-- min_idle whose job no longer exists — no message of its queue with its id as msg_id or in its
-- headers' job_id, no parked job — such as a job deleted outside lockgate (pgmq.delete), so the
-- batch can finish. A job moves between parked and queued in one transaction, so one
-- statement's snapshot sees it in one place or the other. A member of a queue whose table is
-- gone cannot be judged and is kept. Returns how many members it counted.
-- Locks: membership rows (SKIP LOCKED), queue by queue, then the batch rows of them all, once,
-- in id order (counting queue by queue would lock one queue's batches before another's, out of
-- the order a completion counting several batches keeps). Callers: the bookkeeping sweep,
-- operators.
CREATE OR REPLACE FUNCTION lockgate.reap_batches(min_idle interval DEFAULT '10 minutes', max_rows integer DEFAULT 1000)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    q record;
    lost bigint[];
    batch_ids bigint[] := '{}';
    reaped integer := 0;
BEGIN
    IF min_idle < interval '0' OR max_rows < 0 THEN
        RAISE EXCEPTION 'lockgate: min_idle and max_rows must not be negative (got %, %)', min_idle, max_rows
            USING ERRCODE = 'LG003';
    END IF;
    FOR q IN SELECT DISTINCT m.queue FROM lockgate.batch_jobs m JOIN lockgate.batches b ON b.id = m.batch_id
              WHERE b.state = 'closed' AND b.updated_at < now() - min_idle
                AND m.queue IN (SELECT lockgate._live_queues())
              ORDER BY m.queue LOOP
        EXECUTE format(
            'WITH doomed AS (
                 SELECT m.queue, m.job_id FROM lockgate.batch_jobs m JOIN lockgate.batches b ON b.id = m.batch_id
                  WHERE m.queue = $1 AND m.outcome IS NULL AND b.state = ''closed'' AND b.updated_at < now() - $2
                    AND NOT EXISTS (SELECT 1 FROM %1$s x WHERE x.msg_id = m.job_id)
                    AND NOT EXISTS (SELECT 1 FROM %1$s x WHERE x.headers->>''job_id'' = m.job_id::text)
                    AND NOT EXISTS (SELECT 1 FROM lockgate.parked p WHERE p.job_id = m.job_id)
                  ORDER BY m.job_id LIMIT $3
                    FOR UPDATE OF m SKIP LOCKED)
             SELECT array_agg(d.job_id) FROM doomed d',
            lockgate._queue_table(q.queue, 'q'))
          INTO lost USING q.queue, min_idle, max_rows;
        IF lost IS NOT NULL THEN
            batch_ids := batch_ids || lockgate._drop_memberships(q.queue, lost);
            reaped := reaped + cardinality(lost);
        END IF;
    END LOOP;
    IF cardinality(batch_ids) > 0 THEN
        PERFORM lockgate._count_batches(batch_ids, true);
    END IF;
    RETURN reaped;
END $$;

-- The jobs of a batch counted on their memberships, not yet on its row (lockgate._count_batch_jobs):
-- (succeeded, failed). Readers add them to the row's counts.
CREATE OR REPLACE FUNCTION lockgate._waiting_outcomes(batch_id bigint, OUT s bigint, OUT f bigint)
LANGUAGE sql STABLE AS $$
    SELECT count(*) FILTER (WHERE m.outcome = 'succeeded'), count(*) FILTER (WHERE m.outcome = 'failed')
      FROM lockgate.batch_jobs m WHERE m.batch_id = _waiting_outcomes.batch_id AND m.outcome IS NOT NULL
$$;

-- One batch's progress; no row for an unknown id.
-- Locks: none. Callers: lockgate batch show, Client::batch, SQL users.
CREATE OR REPLACE FUNCTION lockgate.batch(batch_id bigint)
RETURNS TABLE (id bigint, state text, total bigint, succeeded bigint, failed bigint, pending bigint,
               on_finish text, on_success text, on_failure text, properties jsonb, callbacks_pending boolean,
               callback_error text, created_at timestamptz, closed_at timestamptz, finished_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT b.id, b.state, t.total, b.succeeded + o.s, b.failed + o.f, t.total - b.succeeded - o.s - b.failed - o.f,
           b.on_finish, b.on_success, b.on_failure, b.properties, b.callbacks_pending, b.callback_error,
           b.created_at, b.closed_at, b.finished_at
      FROM lockgate.batches b CROSS JOIN LATERAL (SELECT lockgate._batch_total(b) AS total) t
     CROSS JOIN LATERAL lockgate._waiting_outcomes(b.id) o
     WHERE b.id = batch_id
$$;

-- Batches not yet finished (or with callbacks pending), oldest first, for lockgate status.
CREATE OR REPLACE FUNCTION lockgate.unfinished_batches(max_rows integer DEFAULT 20)
RETURNS SETOF lockgate.batches LANGUAGE sql STABLE AS $$
    SELECT (jsonb_populate_record(b, jsonb_build_object('total', lockgate._batch_total(b),
                                                       'succeeded', b.succeeded + o.s, 'failed', b.failed + o.f))).*
      FROM lockgate.batches b CROSS JOIN LATERAL lockgate._waiting_outcomes(b.id) o
     WHERE b.state <> 'finished' OR b.callbacks_pending ORDER BY b.id LIMIT max_rows
$$;

-- Run only by the roles granted them, as lockgate.enqueue (010_enqueue.sql).
REVOKE EXECUTE ON FUNCTION lockgate.create_batch(text, text, text, jsonb), lockgate.close_batch(bigint) FROM PUBLIC;

-- Upgrading from a revision whose README gave a producer's role write grants on lockgate's
-- tables, with which it ran these functions as itself (81 and earlier; 82 to 84 were this
-- change's first versions, which granted less): every grantee that could
-- enqueue then — holding INSERT on a queue's table (every enqueue inserts there) or on
-- lockgate.parked (a limited job's enqueue may insert there instead), PUBLIC included — is
-- granted the five functions a producer now runs, in the migrate's transaction, so that none of
-- its enqueues fails for the upgrade (review helper-86: a grant to PUBLIC, or a role with only
-- the grants an unlimited type needed, was left out), with the reads of the README's grants
-- (the Rust client's and the CLI's schema check reads schema_state). `lockgate doctor` then names its write
-- grants (table_writers). Once only: a grant revoked later is not given again.
DO $$
DECLARE
    r record;
BEGIN
    IF COALESCE((SELECT s.functions_revision FROM lockgate.schema_state s), 0) < 85 THEN
        FOR r IN SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END AS grantee
                   FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
                  WHERE (c.oid = 'lockgate.parked'::regclass
                         OR c.oid IN (SELECT to_regclass(lockgate._queue_table(q.name, 'q')) FROM lockgate.queues q))
                    AND a.privilege_type = 'INSERT' AND a.grantee <> c.relowner LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION lockgate.enqueue(text, jsonb, jsonb, boolean), '
                           'lockgate.enqueue_many(text, jsonb[], jsonb, boolean), '
                           'lockgate._enqueue_many_and_wake(text, jsonb[], jsonb, boolean), '
                           'lockgate.create_batch(text, text, text, jsonb), lockgate.close_batch(bigint) TO %1$s; '
                           'GRANT SELECT ON lockgate.job_types, lockgate.schema_state TO %1$s',
                           r.grantee);
        END LOOP;
    END IF;
END $$;
