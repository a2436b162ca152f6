-- Release (shutdown return, G7): make unfinished deliveries visible at once and count the
-- return, so the next delivery is not counted as another attempt (and set last_read_at of a
-- delivery claimed ahead, so the next claim does not count it as a second return, H32). Fenced
-- on (msg_id, read_ct). A run that had started counts in shutdown_returns; once a job has
-- max_returns of them (NULL: no cap), a further shutdown return is counted as an attempt (returns
-- is not incremented), so a job that always outlives shutdown_timeout cannot cycle forever across
-- deploys; such a return joins the job's attempts (outcome interrupted, sql/068_jobs.sql). A
-- delivery claimed ahead and never started is always a plain return.
-- The message is marked waiting (retry_at), so a heartbeat that raced the return does not push
-- its visibility out again (sql/030_extend.sql); the next claim clears the mark.
-- Permits are kept: the job re-runs holding them, and the lease is renewed so it survives until
-- the next delivery's heartbeat. The runs have ended: while_executing uniqueness locks are
-- given back (the next run takes them again). Returns the msg_ids released.
-- Locks: the updated message rows in msg_id order (as complete's start records do), then their
-- leases, then their unique locks. Callers: the worker pool on shutdown.
CREATE OR REPLACE FUNCTION lockgate.release(queue text, msg_ids bigint[], read_cts integer[], max_returns integer DEFAULT NULL)
RETURNS SETOF bigint LANGUAGE plpgsql AS $$
BEGIN
    IF max_returns < 0 THEN
        RAISE EXCEPTION 'lockgate: invalid max_returns %: 0 or more, or NULL for no cap', max_returns USING ERRCODE = 'LG003';
    END IF;
    RETURN QUERY EXECUTE format(
        'WITH released AS (
             UPDATE %1$s m
                SET vt = clock_timestamp(),
                    last_read_at = COALESCE(m.last_read_at, clock_timestamp()),
                    headers = CASE WHEN jsonb_typeof(m.headers) <> ''object'' THEN m.headers
                                   WHEN NOT d.started
                                   THEN m.headers || jsonb_build_object(''retry_at'', clock_timestamp(), ''returns'',
                                        LEAST(COALESCE((m.headers->>''returns'')::integer, 0) + 1, 999999999))
                                   ELSE m.headers || jsonb_build_object(''retry_at'', clock_timestamp(),
                                        ''returns'', LEAST(COALESCE((m.headers->>''returns'')::integer, 0)
                                            + CASE WHEN $4 IS NOT NULL AND COALESCE((m.headers->>''shutdown_returns'')::integer, 0) >= $4
                                                   THEN 0 ELSE 1 END, 999999999),
                                        ''shutdown_returns'', LEAST(COALESCE((m.headers->>''shutdown_returns'')::integer, 0) + 1, 999999999))
                                   -- Counted as an attempt: it joins the attempt history.
                                   || CASE WHEN $4 IS NOT NULL AND COALESCE((m.headers->>''shutdown_returns'')::integer, 0) >= $4
                                           THEN jsonb_build_object(''errors'', COALESCE(m.headers->''errors'', ''[]'')
                                                || jsonb_build_array(jsonb_build_object(
                                                       ''attempt'', lockgate._attempt_of(m.headers, m.read_ct),
                                                       ''started_at'', m.last_read_at, ''at'', clock_timestamp(),
                                                       ''process'', m.headers->''owner'', ''outcome'', ''interrupted'',
                                                       ''error'', format(''returned by shutdown after %%s free returns'', $4))))
                                           ELSE ''{}'' END
                              END
               FROM (SELECT x.msg_id, x.last_read_at IS NOT NULL AS started
                       FROM %1$s x JOIN unnest($1::bigint[], $2::integer[]) AS d(msg_id, read_ct)
                         ON x.msg_id = d.msg_id AND x.read_ct = d.read_ct
                      -- Released already (a retry after a reply lost in a committed release):
                      -- a return is counted once.
                      WHERE NOT (jsonb_typeof(x.headers) = ''object'' AND x.headers ? ''retry_at'')
                      ORDER BY x.msg_id FOR UPDATE OF x) d
              WHERE m.msg_id = d.msg_id
             RETURNING m.msg_id, m.headers),
         renewed AS (
             UPDATE lockgate.leases l
                SET expires_at = GREATEST(l.expires_at, clock_timestamp() + lockgate._lease_interval(l.duration_ms, (SELECT lockgate._lease_floor_ms())))
               FROM released r WHERE l.queue = $3 AND l.msg_id = r.msg_id),
         unlocked AS (
             DELETE FROM lockgate.unique_locks u USING released r
              WHERE r.headers ? ''wkey'' AND u.queue = $3 AND u.mode = ''while_executing''
                AND u.job_id = COALESCE(lockgate._job_id_of(r.headers), r.msg_id) AND u.msg_id = r.msg_id)
         SELECT msg_id FROM released',
        lockgate._queue_table(queue, 'q'))
      USING msg_ids, read_cts, queue, max_returns;
    PERFORM pg_notify('lockgate_' || queue, '');
END $$;

-- Returns one delivery that never started (its claim was answered too late to start a handler
-- that could still be stopped in time, H27) as a delivery claimed ahead and never started is
-- returned: a plain return, never a shutdown return, so it counts neither as an attempt nor
-- towards max_returns (H32; review helper-82: such returns used the free shutdown returns up,
-- then dead-lettered a job that had never run). Fenced on (msg_id, read_ct); true when returned.
-- Locks: as lockgate.release. Callers: the worker, for a delivery it did not start.
CREATE OR REPLACE FUNCTION lockgate.return_unstarted(queue text, msg_id bigint, read_ct integer)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('UPDATE %s m SET last_read_at = NULL WHERE m.msg_id = $1 AND m.read_ct = $2',
                   lockgate._queue_table(queue, 'q'))
      USING msg_id, read_ct;
    RETURN EXISTS (SELECT 1 FROM lockgate.release(queue, ARRAY[msg_id], ARRAY[read_ct], NULL));
END $$;
