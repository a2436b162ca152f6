-- The statements of `sql` jobs, fenced on the server (docs/design.md §100).
--
-- An `sql` job's statement runs in a database backend, which nothing that happens to its
-- `lockgate run` stops: a lockgate frozen (SIGSTOP, a paused VM) or cut off from the database
-- renews nothing, its job's lease lapses, and the statement ran on beside the job's next delivery
-- or the next job of its key. So the backend running a job's statement carries the job's mark,
-- its application_name (lockgate._statement_tag), from before the statement starts until its
-- transaction ends; and whatever takes the job from a silent holder ends that backend first: the
-- sweep that expires the job's lease (sql/080_sweep.sql), the claim that delivers the job again
-- (sql/020_claim.sql). A mark is set only by a delivery that still owns its job
-- (lockgate.start_statement), under a lock that orders it with those two:
-- - a claim delivering the job again holds the message row from its take until it commits, and
--   reads the marks after its take: a start that locks the row after the take waits for that
--   commit and then finds another delivery's read_ct; one whose mark was set before the claim
--   read the marks is ended by the claim;
-- - a sweep expires only a lease past its end, and a running delivery's visibility never outlives
--   its lease (vt <= expires_at, sql/020_claim.sql and sql/030_extend.sql): a start that finds
--   its visibility still running set its mark before any sweep that may expire its lease began,
--   and that sweep reads the marks after it locked the lease.
-- A mark outlives its statement only on a direct connection whose lockgate froze before clearing
-- it (the `sql` executor clears it once the statement has ended); ending that idle backend is
-- harmless. Only the marks of roles that may renew leases (UPDATE on lockgate.leases, as every
-- worker's role may) count: any role that may connect can set its application_name, and a role
-- without lockgate's rights must not hold a job by wearing its mark.

-- The mark of a backend running a statement of job msg_id of queue: 'lockgate job <msg_id> <queue>',
-- within application_name's 63 bytes (a queue name that does not fit is cut, with a hash of the
-- whole name after it, so two queues never share a mark).
CREATE OR REPLACE FUNCTION lockgate._statement_tag(queue text, msg_id bigint)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN octet_length(t) <= 63 THEN t
                ELSE left(t, 54) || '~' || left(md5(queue), 8) END
      FROM (SELECT 'lockgate job ' || msg_id || ' ' || queue AS t) s
$$;

-- Called on the connection that is about to run an `sql` job's statement, in the transaction
-- that will run it when local (so that the mark ends with it; under a transaction-mode pooler
-- the only way to keep mark and statement on one server), or for the session otherwise (the
-- caller then clears it with RESET application_name once the statement has ended): marks the
-- backend as running the statement of delivery (queue, msg_id, read_ct) and returns its pid;
-- or returns NULL, leaving the application_name as it was, when the delivery no longer owns
-- its job: delivered again since (another read_ct), ended (the message gone), waiting (returned
-- or retrying: retry_at), past its visibility (a lapsed delivery, whose lease a sweep may be
-- expiring) or, for a limited job, without a live lease. The statement must then not run.
-- Locks: the message row FOR SHARE, then the lease row FOR KEY SHARE (the order of every path),
-- in a subtransaction rolled back before the function returns, so that nothing is held while the
-- statement runs (a renewal would skip the rows and report them busy). The locks wait for a claim
-- or sweep that is taking the job, so that the order above holds even if the server's clock
-- steps back between their reads of it and this one.
-- Callers: the `sql` executor (crates/lockgate-cli/src/executors/sql.rs).
CREATE OR REPLACE FUNCTION lockgate.start_statement(queue text, msg_id bigint, read_ct integer,
                                                    local boolean DEFAULT false)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    tbl text := lockgate._queue_table(queue, 'q'::text);
    was text := current_setting('application_name');
    owns boolean := false;
    limited boolean;
BEGIN
    -- Marked first: a claim or sweep that began after the mark sees it.
    PERFORM set_config('application_name', lockgate._statement_tag(queue, msg_id), local);
    IF NOT local THEN
        -- Its own transaction, which takes row locks and writes nothing worth a flush: its commit
        -- does not wait for one (review helper-113 F2). Not when local: that transaction is the
        -- job's, whose statement's commit must be durable.
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    BEGIN
        EXECUTE format(
            'SELECT m.vt > clock_timestamp() AND NOT COALESCE(m.headers ? ''retry_at'', false),
                    COALESCE(m.headers ? ''ckey'', false)
               FROM %s m WHERE m.msg_id = $1 AND m.read_ct = $2 FOR SHARE', tbl)
           INTO owns, limited USING msg_id, read_ct;
        IF owns AND limited THEN
            -- A running delivery of a limited job holds a lease (sql/020_claim.sql); one a sweep
            -- is expiring is waited for, and found gone.
            PERFORM 1 FROM lockgate.leases l
              WHERE l.queue = start_statement.queue AND l.msg_id = start_statement.msg_id
                AND l.expires_at > clock_timestamp() AND l.finished_at IS NULL
                FOR KEY SHARE;
            owns := FOUND;
        END IF;
        -- Rolls the subtransaction back, and with it the row lock.
        RAISE EXCEPTION USING ERRCODE = 'LG900';
    EXCEPTION WHEN SQLSTATE 'LG900' THEN
        NULL;
    END;
    IF owns THEN
        RETURN pg_backend_pid();
    END IF;
    PERFORM set_config('application_name', was, local);
    RETURN NULL;
END $$;

-- The marks of the backends of this database, other than the caller's, running a statement of a
-- job: empty, almost always (another database's lockgate has jobs of the same ids). Only those of
-- roles that may renew leases, as lockgate's workers may (see above). Read afresh (a transaction keeps the first activity it read, and a mark set since counts).
-- Callers: lockgate.sweep, lockgate.claim, before they hand a job on.
CREATE OR REPLACE FUNCTION lockgate._statement_marks()
RETURNS text[] LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_stat_clear_snapshot();
    RETURN ARRAY(SELECT a.application_name FROM pg_stat_get_activity(NULL::integer) a
                  WHERE a.application_name LIKE 'lockgate job %' AND a.pid <> pg_backend_pid()
                    AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
                    AND has_table_privilege(a.usesysid, 'lockgate.leases', 'UPDATE'));
END $$;

-- Ends the backends of this database, other than the caller's, that carry one of tags
-- (lockgate._statement_tag) as lockgate._statement_marks counts them, and waits for them to exit,
-- until `until` (NULL: 200 ms from now; a terminated backend exits within milliseconds; the
-- caller holds the job's rows meanwhile, within the runtime's statement_timeout, so a caller that
-- calls it for several jobs passes one deadline for all of them); returns the tags of those still
-- running (one this role may not terminate, or that has not exited yet), whose jobs the caller
-- must not hand on: the statement may still be running. A later sweep or claim looks again.
-- Callers: lockgate.sweep, lockgate.claim, for the marks lockgate._statement_marks found.
CREATE OR REPLACE FUNCTION lockgate._end_statements(tags text[], until timestamptz DEFAULT NULL)
RETURNS text[] LANGUAGE plpgsql SET client_min_messages = error AS $$
DECLARE
    b record;
    ending integer[] := '{}';
    running text[] := '{}';
BEGIN
    until := COALESCE(until, clock_timestamp() + interval '200 milliseconds');
    PERFORM pg_stat_clear_snapshot();
    FOR b IN SELECT a.pid, a.application_name AS tag FROM pg_stat_get_activity(NULL::integer) a
              WHERE a.application_name = ANY (tags) AND a.pid <> pg_backend_pid()
                AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
                AND has_table_privilege(a.usesysid, 'lockgate.leases', 'UPDATE') LOOP
        BEGIN
            -- False when the backend was gone already (then it has ended).
            IF pg_terminate_backend(b.pid) THEN
                ending := ending || b.pid;
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            running := running || b.tag;
        END;
    END LOOP;
    -- Waited for in 1 ms steps (pg_terminate_backend's own wait looks every 100 ms): a backend
    -- leaves the server's activity as it exits, after its statement has stopped for good (the
    -- terminate is a FATAL error in it); its transaction is rolled back on the way.
    WHILE cardinality(ending) > 0 LOOP
        PERFORM pg_stat_clear_snapshot();
        ending := ARRAY(SELECT e FROM unnest(ending) e
                         WHERE EXISTS (SELECT 1 FROM pg_stat_get_activity(e) a WHERE a.application_name = ANY (tags)));
        EXIT WHEN cardinality(ending) = 0 OR clock_timestamp() >= until;
        PERFORM pg_sleep(0.001);
    END LOOP;
    RETURN running || ARRAY(SELECT a.application_name FROM unnest(ending) e, pg_stat_get_activity(e) a
                             WHERE a.application_name = ANY (tags));
END $$;
