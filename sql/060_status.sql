-- Queue statistics for lockgate status and the metrics: per queue, jobs ready now (or put back
-- for a second because their key was busy, as lockgate.jobs() shows them: queued), scheduled
-- (delayed or waiting for a retry), running (claimed and not yet finished), dead-lettered, and
-- how long the oldest ready job has waited since it became ready, and whether the queue is
-- paused (lockgate.pause_queue).
-- Locks: none (plain reads). Callers: lockgate status, tests, operators.
CREATE OR REPLACE FUNCTION lockgate.queue_stats()
RETURNS TABLE (queue text, ready bigint, scheduled bigint, running bigint, dead bigint, oldest_ready_seconds double precision,
               paused boolean)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    q record;
BEGIN
    -- (A vt of -infinity, written by hand, is ready but has no age: now() minus it is an error
    -- that failed every queue's line, review helper-78.)
    FOR q IN SELECT lockgate._live_queues() AS name LOOP
        queue := q.name;
        EXECUTE format(
            'SELECT count(*) FILTER (WHERE vt <= now() OR (headers->''retry_at'' = headers->''put_back_until'')),
                    count(*) FILTER (WHERE vt > now() AND (read_ct = 0 OR headers ? ''retry_at'')
                                     AND (headers->''retry_at'' = headers->''put_back_until'') IS NOT TRUE),
                    count(*) FILTER (WHERE vt > now() AND read_ct > 0 AND NOT headers ? ''retry_at''),
                    extract(epoch FROM now() - min(vt) FILTER (WHERE vt <= now() AND isfinite(vt)))::double precision
               FROM %s', lockgate._queue_table(q.name, 'q'))
           INTO ready, scheduled, running, oldest_ready_seconds;
        SELECT count(*) INTO dead FROM lockgate.dead_letters d WHERE d.queue = q.name;
        SELECT x.paused_at IS NOT NULL INTO paused FROM lockgate.queues x WHERE x.name = q.name;
        RETURN NEXT;
    END LOOP;
END $$;

-- Throughput for lockgate status and the dashboard: per queue, the jobs that succeeded (were
-- archived after running; cancelled and discarded ones are read but not counted) and failed for good (were dead-lettered, and are still in the dead letters: a retried
-- or purged dead letter no longer counts) in the last minute and the last hour. Archived jobs are
-- counted through PGMQ's archived_at index, newest first, reading at most max_rows entries per
-- queue, so the cost is bounded whatever the volume; a count that reached max_rows is a lower
-- bound, and succeeded_capped says so (an extrapolation from the newest rows' rate would be off
-- by the burst every time the hour was uneven). Dead letters are read through their (queue,
-- dead_at) index (migrations/0014).
-- Locks: none (plain reads). Callers: lockgate status, the dashboard, operators.
--   $1 max_rows: archive index entries read per queue at most (100,000: some tens of
--      milliseconds; exact up to about 28 jobs a second over the hour, 1,600 over the minute).
CREATE OR REPLACE FUNCTION lockgate.queue_throughput(max_rows integer DEFAULT 100000)
RETURNS TABLE (queue text, succeeded_last_minute bigint, succeeded_last_hour bigint, succeeded_capped boolean,
               failed_last_minute bigint, failed_last_hour bigint)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    q record;
BEGIN
    IF max_rows IS NULL OR max_rows < 1 THEN
        RAISE EXCEPTION 'lockgate: invalid max_rows %: 1 or more', max_rows USING ERRCODE = 'LG003';
    END IF;
    FOR q IN SELECT lockgate._live_queues() AS name LOOP
        queue := q.name;
        EXECUTE format(
            'SELECT count(*) FILTER (WHERE t.archived_at > now() - interval ''1 minute'' AND t.succeeded),
                    count(*) FILTER (WHERE t.succeeded), count(*) >= $1
               FROM (SELECT a.archived_at, lockgate._archived_state(a.headers) = ''succeeded'' AS succeeded
                       FROM %s a WHERE a.archived_at > now() - interval ''1 hour''
                      ORDER BY a.archived_at DESC LIMIT $1) t',
            lockgate._queue_table(q.name, 'a'))
           INTO succeeded_last_minute, succeeded_last_hour, succeeded_capped USING max_rows;
        SELECT count(*) FILTER (WHERE d.dead_at > now() - interval '1 minute'),
               count(*) FILTER (WHERE d.dead_at > now() - interval '1 hour')
          INTO failed_last_minute, failed_last_hour
          FROM lockgate.dead_letters d WHERE d.queue = q.name AND d.dead_at > now() - interval '1 hour';
        RETURN NEXT;
    END LOOP;
END $$;
