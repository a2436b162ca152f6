-- The concurrency sweep (dispatcher), in one transaction:
-- 1. delete leases whose silence budget ran out, and leases whose message no longer exists,
--    giving their permits back (a dead holder's permit is freed within one sweep, G5);
-- 2. promote parked jobs of keys that can take a permit now — filtered in SQL, oldest-waiting
--    key first, at most max_keys keys per pass — so thousands of held keys can never starve a
--    key whose holder died (H15). Keys whose holders are alive promote at their completion.
-- Returns counts. now_override pins the clock for tests; NULL means the database's clock.
-- Locks: expired lease rows, then semaphore rows in key order, then parked rows.
-- Callers: the sweep service every sweep_interval, operators.
CREATE OR REPLACE FUNCTION lockgate.sweep(max_keys integer DEFAULT 1000, now_override timestamptz DEFAULT NULL,
    OUT expired integer, OUT orphaned integer, OUT promoted integer)
LANGUAGE plpgsql AS $$
DECLARE
    at timestamptz := COALESCE(now_override, clock_timestamp());
    k record;
    q record;
    promotions lockgate.promotion[] := '{}';
BEGIN
    expired := 0;
    orphaned := 0;
    promoted := 0;
    FOR k IN
        WITH gone AS (DELETE FROM lockgate.leases l WHERE l.expires_at < at RETURNING l.key)
        SELECT g.key, count(*)::integer AS n FROM gone g GROUP BY g.key ORDER BY g.key
    LOOP
        PERFORM lockgate._give_back(k.key, k.n);
        expired := expired + k.n;
    END LOOP;
    FOR q IN SELECT DISTINCT l.queue FROM lockgate.leases l
              WHERE EXISTS (SELECT 1 FROM lockgate.queues x WHERE x.name = l.queue) LOOP
        FOR k IN EXECUTE format(
            'WITH gone AS (
                 DELETE FROM lockgate.leases l WHERE l.queue = $1
                    AND NOT EXISTS (SELECT 1 FROM %s m WHERE m.msg_id = l.msg_id)
                 RETURNING l.key)
             SELECT g.key, count(*)::integer AS n FROM gone g GROUP BY g.key ORDER BY g.key',
            lockgate._queue_table(q.queue, 'q'))
          USING q.queue
        LOOP
            PERFORM lockgate._give_back(k.key, k.n);
            orphaned := orphaned + k.n;
        END LOOP;
    END LOOP;
    -- Room is judged against the type's current limit (a raised limit frees room at once); a
    -- key whose type is gone or no longer limited is taken too, to dead-letter or release it.
    FOR k IN
        SELECT p.key FROM lockgate.parked p
          LEFT JOIN lockgate.semaphores s ON s.key = p.key
          LEFT JOIN lockgate.job_types jt ON jt.name = p.job_type
         WHERE s.key IS NULL OR jt.name IS NULL OR jt.concurrency_limit IS NULL OR s.value < jt.concurrency_limit
         GROUP BY p.key ORDER BY min(p.parked_at) LIMIT max_keys
    LOOP
        promotions := promotions || ARRAY(SELECT p FROM lockgate._promote(k.key) p);
    END LOOP;
    promoted := lockgate._send_promotions(promotions);
END $$;
