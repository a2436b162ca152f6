-- Retry in place: a failed attempt keeps its message and its permit, and becomes
-- visible again after the backoff. The error joins the attempt history in the headers (with the
-- attempt's start and the process that ran it: sql/068_jobs.sql), and
-- retry_at marks the delivery as waiting (not running) for status. Fenced on (msg_id, read_ct):
-- a stale delivery's failure changes nothing. The run started, so its start is recorded if it
-- was not yet (last_read_at, H32). The lease is stretched to cover the backoff
-- (G6). The run has ended, so a while_executing uniqueness lock is given back (the next run
-- takes it again). Returns whether this delivery still owned it. Written once per delivery: a call
-- sent again after its reply was lost (the worker retries its final statement after a
-- connection error) finds the delivery retried already (retry_at set: a claim takes the mark
-- off) and returns true, writing nothing (review helper-135 F1: the attempt's error was recorded
-- twice and its backoff pushed).
-- Locks: the message row, then its lease row, then its unique lock. Callers: the worker after a
-- failed attempt.
CREATE OR REPLACE FUNCTION lockgate.retry(
    queue text, msg_id bigint, read_ct integer, delay_seconds double precision, error text, attempt integer
) RETURNS boolean LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    retry_at timestamptz := clock_timestamp() + make_interval(secs => delay_seconds);
    found_id bigint;
    found_headers jsonb;
BEGIN
    EXECUTE format(
        'UPDATE %s m
            SET vt = $3,
                last_read_at = COALESCE(m.last_read_at, clock_timestamp()),
                headers = m.headers
                    || jsonb_build_object(''retry_at'', $3)
                    || jsonb_build_object(''errors'', COALESCE(m.headers->''errors'', ''[]'')
                          || jsonb_build_array(jsonb_build_object(
                               ''attempt'', $5, ''started_at'', COALESCE(m.last_read_at, clock_timestamp()),
                               ''at'', clock_timestamp(), ''process'', m.headers->''owner'', ''error'', left($4, 4000))))
          WHERE m.msg_id = $1 AND m.read_ct = $2 AND NOT m.headers ? ''retry_at''
         RETURNING m.msg_id, m.headers',
        lockgate._queue_table(queue, 'q'))
       INTO found_id, found_headers
      USING retry.msg_id, retry.read_ct, retry_at, error, attempt;
    IF found_id IS NULL THEN
        EXECUTE format('SELECT m.msg_id FROM %s m WHERE m.msg_id = $1 AND m.read_ct = $2 AND m.headers ? ''retry_at''',
                       lockgate._queue_table(queue, 'q'))
           INTO found_id USING retry.msg_id, retry.read_ct;
        RETURN found_id IS NOT NULL;
    END IF;
    UPDATE lockgate.leases l SET expires_at = GREATEST(l.expires_at, retry_at + lockgate._lease_interval(l.duration_ms))
     WHERE l.queue = retry.queue AND l.msg_id = retry.msg_id;
    IF found_headers ? 'wkey' THEN
        PERFORM lockgate._release_unique(queue, ARRAY[COALESCE(lockgate._job_id_of(found_headers), found_id)],
                                         ARRAY[found_id], true);
    END IF;
    RETURN true;
END $$;
