-- Queue statistics for lockgate status and the metrics: per queue, jobs ready now, scheduled
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
    FOR q IN SELECT lockgate._live_queues() AS name LOOP
        queue := q.name;
        EXECUTE format(
            'SELECT count(*) FILTER (WHERE vt <= now()),
                    count(*) FILTER (WHERE vt > now() AND (read_ct = 0 OR headers ? ''retry_at'')),
                    count(*) FILTER (WHERE vt > now() AND read_ct > 0 AND NOT headers ? ''retry_at''),
                    extract(epoch FROM now() - min(vt) FILTER (WHERE vt <= now()))::double precision
               FROM %s', lockgate._queue_table(q.name, 'q'))
           INTO ready, scheduled, running, oldest_ready_seconds;
        SELECT count(*) INTO dead FROM lockgate.dead_letters d WHERE d.queue = q.name;
        SELECT x.paused_at IS NOT NULL INTO paused FROM lockgate.queues x WHERE x.name = q.name;
        RETURN NEXT;
    END LOOP;
END $$;
