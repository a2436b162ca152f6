-- Cancel (issue 12): a job leaves for good, in whatever state it is, and is kept in its queue's
-- archive marked cancelled (headers cancelled_at, and cancelled_in: the state it left).
--
-- A job in a queue table (queued, scheduled, retrying, running) has its message deleted and
-- archived, not fenced on a delivery: whichever delivery holds it loses it. In the same
-- transaction, as a completion does, its batch is counted as failed, and a job that was not
-- running gives back its permit (the next parked job of its key is promoted) and its uniqueness
-- lock. A running job keeps its permit and its while_executing lock until its handler has
-- stopped (G3: a permit is never free while a handler of the key may still run, and no second
-- job of a while_executing key starts beside it): its worker, told by its next heartbeat (which
-- finds the message gone, reported as cancelled), stops the handler and then gives them back
-- through lockgate.release_cancelled. If that worker is dead, the lease runs out within its
-- silence budget and the sweep frees it, as for any lease whose message is gone
-- (sql/080_sweep.sql), and the lock is free once the delivery's visibility at the cancel has
-- passed (held_until: its worker's watchdog stops the handler before then, H27). An
-- until_executed lock is released at once: it guards enqueues, not runs. The cancelled delivery's late completion, retry or
-- return changes nothing (fenced on the queue table, where its row no longer is). A cancel racing
-- a completion deletes the same row: one of them wins, the other finds nothing. A running attempt
-- that had started is recorded in the job's attempts with outcome cancelled, after the attempts
-- of its message that recorded nothing, as lost.
--
-- A parked job is deleted from the parked jobs (the others of its key keep their order) and
-- archived under a fresh message id; its uniqueness lock is released and its batch counted.
-- A job already finished (succeeded, discarded, cancelled, dead) is left as it is.
--
-- Returns the job's state when it was cancelled (or found finished) and whether this call
-- cancelled it; no row when no job has that id (or the id is NULL).
-- Locks: as a completion (the message row, its lease, the key's semaphore row, its unique lock,
-- its batch rows), or as lockgate.discard_parked for a parked job.
-- Callers: lockgate job cancel, lockgate jobs cancel (via cancel_jobs), Client::cancel.
CREATE OR REPLACE FUNCTION lockgate.cancel(job_id bigint)
RETURNS TABLE (id bigint, state text, queue text, cancelled boolean) LANGUAGE plpgsql STRICT SET enable_seqscan = off SET jit = off AS $$
DECLARE
    j lockgate.job_info;
    p lockgate.parked;
    gone_id bigint;
    gone_headers jsonb;
    gone_vt timestamptz;
    -- Whether a handler or statement of the job may still run: its permit and key are kept.
    held boolean;
BEGIN
    id := job_id;
    -- A job can move between the lookup and the delete (a completion archived it, a promotion
    -- sent it): then it is looked up again.
    FOR round IN 1..5 LOOP
        SELECT * INTO j FROM lockgate.job(cancel.job_id);
        IF j.id IS NULL THEN
            RETURN;
        END IF;
        state := j.state;
        queue := j.queue;
        cancelled := false;
        IF j.state IN ('queued', 'scheduled', 'retrying', 'running') THEN
            EXECUTE format(
                'WITH gone AS (
                     DELETE FROM %1$s m WHERE m.msg_id = $1
                     RETURNING m.*, lockgate._queued_state(m.vt, m.headers, m.read_ct) AS was)
                 INSERT INTO %2$s (msg_id, vt, read_ct, enqueued_at, last_read_at, message, headers)
                 SELECT g.msg_id, g.vt, g.read_ct, g.enqueued_at, g.last_read_at, g.message,
                        h.headers - ''retry_at''
                        || jsonb_build_object(''cancelled_at'', clock_timestamp(), ''cancelled_in'', g.was)
                        || CASE WHEN g.was = ''running'' AND g.last_read_at IS NOT NULL
                                THEN jsonb_build_object(''errors'', COALESCE(h.headers->''errors'', ''[]'')
                                     || jsonb_build_array(jsonb_build_object(
                                            ''attempt'', lockgate._attempt_of(g.headers, g.read_ct), ''started_at'', g.last_read_at, ''at'', clock_timestamp(),
                                            ''process'', h.headers->''owner'', ''outcome'', ''cancelled'',
                                            ''error'', ''cancelled'')))
                                ELSE ''{}'' END
                   FROM gone g
                  -- Its attempts that recorded nothing (their worker was killed) are written down
                  -- as lost: the history of an archived cancelled job is read as it is stored.
                  CROSS JOIN LATERAL (SELECT CASE WHEN jsonb_typeof(g.headers) = ''object''
                                                  THEN lockgate._record_lost(g.headers, lockgate._attempts_before(g.headers),
                                                           lockgate._lost_upto(g.headers, g.read_ct, g.was, g.last_read_at))
                                                  ELSE jsonb_build_object(''original_headers'', g.headers) END AS headers) h
                 RETURNING msg_id, headers, vt',
                lockgate._queue_table(j.queue, 'q'), lockgate._queue_table(j.queue, 'a'))
               INTO gone_id, gone_headers, gone_vt
              USING j.msg_id;
            IF gone_id IS NULL THEN
                CONTINUE;
            END IF;
            -- The state it was in when this delete took it (a claim may have run since the lookup).
            state := gone_headers->>'cancelled_in';
            -- Its `sql` statement, if one still runs on a backend that carries its mark, is ended
            -- here, whatever state the job was in: its worker, frozen or cut off, cannot end it,
            -- and with the message gone no claim delivers the job again and no sweep expires a
            -- lease of an unlimited job, which would end it otherwise (docs/design.md §100, §120;
            -- reviews helper-113 F1, helper-139 F2: a cancelled job's statement committed its
            -- work 18 s after the cancel). A statement that could not be ended keeps the job
            -- treated as running, as a running job always is: its permit and key kept for the
            -- sweep and the next taker of the key, which end the statement before they hand them
            -- on. No new mark can come: the message is gone.
            held := cardinality(lockgate._end_statements(ARRAY[lockgate._statement_tag(j.queue, gone_id)])) > 0;
            held := held OR gone_headers->>'cancelled_in' = 'running';
            -- A running job's permit waits for its handler to stop (release_cancelled).
            IF gone_headers ? 'ckey' AND NOT held THEN
                PERFORM lockgate._release_leases(j.queue, ARRAY[gone_id]);
            END IF;
            IF gone_headers ? 'wkey' AND held THEN
                -- Kept for its handler: until release_cancelled, or until its visibility ends.
                UPDATE lockgate.unique_locks u SET held_until = gone_vt
                 WHERE u.queue = j.queue AND u.job_id = j.id AND u.msg_id = gone_id AND u.mode = 'while_executing';
            ELSIF gone_headers ? 'ukey' OR gone_headers ? 'wkey' THEN
                PERFORM lockgate._release_unique(j.queue, ARRAY[j.id], ARRAY[gone_id]);
            END IF;
            IF gone_headers ? 'batch' THEN
                PERFORM lockgate._count_batch_jobs(j.queue, ARRAY[j.id], true, ARRAY[gone_id]);
            END IF;
            cancelled := true;
        ELSIF j.state = 'parked' THEN
            DELETE FROM lockgate.parked x WHERE x.job_id = cancel.job_id RETURNING x.* INTO p;
            IF NOT FOUND THEN
                CONTINUE;
            END IF;
            IF p.queue NOT IN (SELECT lockgate._live_queues()) THEN
                -- Its queue is gone: kept with the dead letters, as its promotion would have done,
                -- so nothing is lost.
                PERFORM lockgate._dead_letter_parked(p, format('cancelled while parked; queue "%s" no longer exists', p.queue));
                PERFORM lockgate._promote_behind(p.key);
                cancelled := true;
                RETURN NEXT;
                RETURN;
            END IF;
            EXECUTE format('INSERT INTO %s (msg_id, vt, read_ct, enqueued_at, message, headers)
                            VALUES (nextval(''lockgate.job_id_seq''), $1, 0, $2, $3, $4)',
                           lockgate._queue_table(p.queue, 'a'))
              USING p.run_at, p.parked_at, p.args,
                    p.headers || jsonb_build_object('job_id', p.job_id, 'cancelled_at', clock_timestamp(),
                                                    'cancelled_in', 'parked');
            PERFORM lockgate._release_unique(p.queue, ARRAY[p.job_id], ARRAY[NULL::bigint]);
            IF p.headers ? 'batch' THEN
                PERFORM lockgate._count_batch_jobs(p.queue, ARRAY[p.job_id], true, NULL);
            END IF;
            PERFORM lockgate._promote_behind(p.key);
            cancelled := true;
        END IF;
        RETURN NEXT;
        RETURN;
    END LOOP;
    -- Still moving after every round: reported as found, not cancelled; the caller may retry.
    RETURN NEXT;
END $$;

-- Cancels every job matching the filters of lockgate.jobs that can still be cancelled (scheduled,
-- queued, retrying, running, parked; states narrows it further), at most max_rows of them, newest
-- first, each as lockgate.cancel does it and each in a transaction of its own: a procedure, so
-- that cancelling many jobs never holds one job's permit while it waits for another's message
-- (the lock order of a completion, sql/040_complete.sql, which one transaction cancelling jobs of
-- several keys would break). Call it outside a transaction block:
--   CALL lockgate.cancel_jobs(job_type => 'send_email', states => '{queued}');
-- matched and cancelled are set to how many jobs it found and cancelled (a job that finished in
-- between is found, not cancelled).
-- Locks: as lockgate.cancel, one job at a time. Callers: lockgate job cancel, Client::cancel_jobs.
CREATE OR REPLACE PROCEDURE lockgate.cancel_jobs(queue text DEFAULT NULL, job_type text DEFAULT NULL,
                                                 states text[] DEFAULT NULL, key text DEFAULT NULL,
                                                 since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL,
                                                 search text DEFAULT NULL, max_rows integer DEFAULT 1000,
                                                 INOUT matched integer DEFAULT NULL, INOUT cancelled integer DEFAULT NULL)
LANGUAGE plpgsql AS $$
DECLARE
    cancellable text[] := ARRAY['queued', 'scheduled', 'retrying', 'running', 'parked'];
    targets bigint[];
    target bigint;
BEGIN
    PERFORM lockgate._check_states(states);
    targets := ARRAY(SELECT j.id FROM lockgate.jobs(queue, job_type,
                                                    CASE WHEN states IS NULL THEN cancellable
                                                         ELSE ARRAY(SELECT unnest(states) INTERSECT SELECT unnest(cancellable)) END,
                                                    key, since, until, search, max_rows) j);
    matched := cardinality(targets);
    cancelled := 0;
    COMMIT;
    FOREACH target IN ARRAY targets LOOP
        IF EXISTS (SELECT 1 FROM lockgate.cancel(target) c WHERE c.cancelled) THEN
            cancelled := cancelled + 1;
        END IF;
        COMMIT;
    END LOOP;
END $$;

-- Gives back the permit and the while_executing lock of a cancelled running delivery, once its
-- handler has stopped: its worker calls it after it learned of the cancel. Fenced on the delivery
-- that was running when the job was cancelled (the archived message's msg_id and read_ct, with
-- cancelled_in running): any other delivery, or a second call, releases nothing. Returns whether
-- it released anything.
-- Locks: the lease row, then the key's semaphore row (only if free: one a producer holds leaves
-- the permit on a lease marked finished, lockgate._release_leases), then the unique lock row, as
-- a completion. Callers: the worker, after a cancelled handler ended.
CREATE OR REPLACE FUNCTION lockgate.release_cancelled(queue text, msg_id bigint, read_ct integer)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    h jsonb;
    released boolean := false;
BEGIN
    IF queue NOT IN (SELECT lockgate._live_queues()) THEN
        RETURN false;
    END IF;
    EXECUTE format('SELECT a.headers FROM %s a WHERE a.msg_id = $1 AND a.read_ct = $2', lockgate._queue_table(queue, 'a'))
       INTO h
      USING msg_id, read_ct;
    IF jsonb_typeof(h) IS DISTINCT FROM 'object' OR h->>'cancelled_in' IS DISTINCT FROM 'running' THEN
        RETURN false;
    END IF;
    IF h ? 'ckey' THEN
        PERFORM 1 FROM lockgate.leases l
          WHERE l.queue = release_cancelled.queue AND l.msg_id = release_cancelled.msg_id FOR UPDATE;
        IF FOUND THEN
            PERFORM lockgate._release_leases(queue, ARRAY[msg_id]);
            released := true;
        END IF;
    END IF;
    IF h ? 'wkey' THEN
        DELETE FROM lockgate.unique_locks u
         WHERE u.queue = release_cancelled.queue AND u.job_id = COALESCE(lockgate._job_id_of(h), release_cancelled.msg_id)
           AND u.msg_id = release_cancelled.msg_id AND u.mode = 'while_executing' AND u.held_until IS NOT NULL;
        released := released OR FOUND;
    END IF;
    RETURN released;
END $$;

-- Keeps what a cancelled running delivery kept (its permit lease, its while_executing lock) for
-- as long as its handler still runs: a handler that does not stop when told (a Rust handler
-- blocking its thread, which nothing can abort) must not see a second job of its key start beside
-- it when the lease or lock it kept at the cancel runs out (G3; design §95). Its worker's
-- heartbeat calls it every tick until the handler has ended, then gives both back
-- (release_cancelled). Fenced as release_cancelled is: only the delivery that was running when its
-- job was cancelled (the archived message with its msg_id and read_ct, cancelled_in running)
-- renews anything, and only a lease and lock still held (a lease marked finished is given back
-- already, sql/015_concurrency.sql): one already expired (the worker was
-- silent past its budget, and the sweep may have freed it) is not taken back. The lease moves to
-- a fresh silence budget, as lockgate.extend renews it; the lock to vt_seconds from now, as a
-- delivery's visibility. Never waits for a row lock (H28): a row another statement holds (its
-- own release_cancelled, the sweep) is skipped and the delivery reported busy. Returns one row
-- per delivery that still holds something: busy when it was skipped. A delivery missing from the
-- result holds nothing any more (or held nothing), and is not asked about again.
-- Locks: lease rows, then unique lock rows, both SKIP LOCKED. Callers: the heartbeat.
CREATE OR REPLACE FUNCTION lockgate.extend_cancelled(queue text, msg_ids bigint[], read_cts integer[],
                                                     vt_seconds double precision)
RETURNS TABLE (msg_id bigint, busy boolean) LANGUAGE plpgsql AS $$
BEGIN
    IF vt_seconds IS NULL OR NOT vt_seconds > 0 OR vt_seconds IN ('infinity', 'NaN') THEN
        RAISE EXCEPTION 'lockgate: invalid visibility timeout % seconds: a positive, finite number', vt_seconds
            USING ERRCODE = 'LG003';
    END IF;
    IF queue NOT IN (SELECT lockgate._live_queues()) THEN
        RETURN;
    END IF;
    RETURN QUERY EXECUTE format(
        'WITH cancelled AS (
             SELECT a.msg_id, COALESCE(lockgate._job_id_of(a.headers), a.msg_id) AS job_id
               FROM %s a JOIN unnest($2::bigint[], $3::integer[]) AS d(msg_id, read_ct)
                 ON a.msg_id = d.msg_id AND a.read_ct = d.read_ct
              WHERE jsonb_typeof(a.headers) = ''object'' AND a.headers->>''cancelled_in'' = ''running''),
         held_leases AS (
             SELECT l.msg_id, l.expires_at > clock_timestamp() AND l.finished_at IS NULL AS live
               FROM lockgate.leases l JOIN cancelled c ON l.queue = $1 AND l.msg_id = c.msg_id),
         free_leases AS (
             SELECT x.queue, x.msg_id FROM lockgate.leases x JOIN cancelled c ON x.queue = $1 AND x.msg_id = c.msg_id
              WHERE x.expires_at > clock_timestamp() AND x.finished_at IS NULL
              ORDER BY x.msg_id
                FOR UPDATE OF x SKIP LOCKED),
         leased AS (
             UPDATE lockgate.leases l
                SET expires_at = GREATEST(l.expires_at, clock_timestamp()
                                 + lockgate._lease_interval(l.duration_ms, (SELECT lockgate._lease_floor_ms())))
               FROM free_leases f
              WHERE l.queue = f.queue AND l.msg_id = f.msg_id
             RETURNING l.msg_id),
         held_locks AS (
             SELECT u.msg_id FROM lockgate.unique_locks u JOIN cancelled c ON u.queue = $1 AND u.job_id = c.job_id
                                                                      AND u.msg_id = c.msg_id
              WHERE u.mode = ''while_executing'' AND u.held_until > clock_timestamp()),
         free_locks AS (
             SELECT u.key FROM lockgate.unique_locks u JOIN cancelled c ON u.queue = $1 AND u.job_id = c.job_id
                                                                   AND u.msg_id = c.msg_id
              WHERE u.mode = ''while_executing'' AND u.held_until > clock_timestamp()
              ORDER BY u.key
                FOR UPDATE OF u SKIP LOCKED),
         locked AS (
             UPDATE lockgate.unique_locks u
                SET held_until = GREATEST(u.held_until, clock_timestamp() + make_interval(secs => $4))
               FROM free_locks f
              WHERE u.key = f.key
             RETURNING u.msg_id)
         SELECT h.msg_id, bool_or(h.skipped)
           FROM (SELECT l.msg_id, NOT EXISTS (SELECT 1 FROM leased WHERE leased.msg_id = l.msg_id) AS skipped
                   FROM held_leases l WHERE l.live
                 UNION ALL
                 SELECT k.msg_id, NOT EXISTS (SELECT 1 FROM locked WHERE locked.msg_id = k.msg_id)
                   FROM held_locks k) h
          GROUP BY h.msg_id',
        lockgate._queue_table(queue, 'a'))
      USING queue, msg_ids, read_cts, vt_seconds;
END $$;

-- Which of the deliveries (msg_ids[i], read_cts[i]) of queue the heartbeat found gone were
-- cancelled while they held their job: their archived message carries cancelled_at and the same
-- read_ct. One primary-key lookup per message, only for lost deliveries; nothing for a queue
-- whose table is gone.
-- Locks: none. Callers: the heartbeat.
CREATE OR REPLACE FUNCTION lockgate.cancelled_messages(queue text, msg_ids bigint[], read_cts integer[])
RETURNS SETOF bigint LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF queue NOT IN (SELECT lockgate._live_queues()) THEN
        RETURN;
    END IF;
    RETURN QUERY EXECUTE format(
        'SELECT a.msg_id FROM %s a JOIN unnest($1::bigint[], $2::integer[]) AS k(msg_id, read_ct)
             ON a.msg_id = k.msg_id AND a.read_ct = k.read_ct
          WHERE jsonb_typeof(a.headers) = ''object'' AND a.headers ? ''cancelled_at''',
        lockgate._queue_table(queue, 'a'))
      USING msg_ids, read_cts;
END $$;

-- Deletes a dead or parked job for good (the job view's discard): a dead job's dead letters as
-- lockgate.dlq_purge deletes them, a parked job as lockgate.discard_parked. Returns the state it
-- was discarded from, or the state it is in when it is neither (nothing done), or NULL for an
-- unknown id. A job that moved while this waited for its row (a retry or a promotion committed
-- first) is looked up again, so the state returned is the one it is in: before, a discard that
-- found nothing to delete returned the state it had read, "dead", and the CLI said "job 7 is
-- dead: only a dead or parked job can be discarded" (review helper-144 F2).
-- Locks: as dlq_purge or discard_parked. Callers: lockgate job discard, SQL operators.
CREATE OR REPLACE FUNCTION lockgate.discard_job(job_id bigint, OUT state text, OUT discarded boolean)
LANGUAGE plpgsql STRICT AS $$
DECLARE
    parked_id bigint;
BEGIN
    discarded := false;
    FOR round IN 1..3 LOOP
        SELECT j.state INTO state FROM lockgate.job(discard_job.job_id) j;
        IF state = 'dead' THEN
            discarded := lockgate.dlq_purge(NULL, ARRAY[discard_job.job_id]) > 0;
        ELSIF state = 'parked' THEN
            SELECT p.id INTO parked_id FROM lockgate.parked p WHERE p.job_id = discard_job.job_id;
            discarded := parked_id IS NOT NULL AND lockgate.discard_parked(parked_id);
        ELSE
            RETURN;
        END IF;
        IF discarded THEN
            RETURN;
        END IF;
    END LOOP;
END $$;
