-- The concurrency sweep (dispatcher), in one transaction:
-- 1. delete leases whose silence budget ran out, giving their permits back (a dead holder's
--    permit is freed within one sweep, G5). A lease whose message no longer exists (removed
--    outside lockgate, by pgmq.archive or pgmq.delete) is no exception: its holder may still be
--    running until its budget ends, so it too is freed only when it expires (counted as orphaned);
-- 2. promote parked jobs of keys that can take a permit now — filtered in SQL, oldest-waiting
--    key first, at most max_keys keys per pass — so thousands of held keys can never starve a
--    key whose holder died (H15). Keys whose holders are alive promote at their completion.
-- Returns counts. now_override pins the clock for tests; NULL means the database's clock.
--
-- Never waits for a lock (H28, H31): a key's semaphore row or a lease that another transaction
-- holds (an open producer transaction, a completion, a claim renewing the lease) is skipped and
-- taken by a later pass; so one held key can never stall the sweep of every other key. Locks, in
-- the order every path keeps: semaphore rows in key order (SKIP LOCKED), then the expired lease
-- rows of those keys (SKIP LOCKED; a lease a claim or heartbeat just renewed is re-checked and
-- kept), then parked rows (SKIP LOCKED).
-- Callers: the sweep service every sweep_interval, operators.
CREATE OR REPLACE FUNCTION lockgate.sweep(max_keys integer DEFAULT 1000, now_override timestamptz DEFAULT NULL,
    OUT expired integer, OUT orphaned integer, OUT promoted integer)
LANGUAGE plpgsql AS $$
DECLARE
    at timestamptz := COALESCE(now_override, clock_timestamp());
    keys text[];
    orphan_queues text[] := '{}';
    orphan_ids bigint[] := '{}';
    k record;
    q record;
    promotions lockgate.promotion[] := '{}';
BEGIN
    -- Expired leases whose message no longer exists, for the count. Found without locks.
    FOR q IN SELECT DISTINCT l.queue FROM lockgate.leases l
              WHERE l.expires_at < at AND l.queue IN (SELECT lockgate._live_queues()) LOOP
        EXECUTE format(
            'SELECT $2 || COALESCE(array_agg(l.msg_id), ''{}'') FROM lockgate.leases l
              WHERE l.queue = $1 AND l.expires_at < $3 AND NOT EXISTS (SELECT 1 FROM %s m WHERE m.msg_id = l.msg_id)',
            lockgate._queue_table(q.queue, 'q'))
          INTO orphan_ids USING q.queue, orphan_ids, at;
        orphan_queues := orphan_queues || array_fill(q.queue, ARRAY[cardinality(orphan_ids) - cardinality(orphan_queues)]);
    END LOOP;
    -- 1. Keys with an expired lease whose semaphore row is free now.
    SELECT array_agg(s.key ORDER BY s.key) INTO keys
      FROM (SELECT x.key FROM lockgate.semaphores x
             WHERE x.key IN (SELECT l.key FROM lockgate.leases l WHERE l.expires_at < at)
             ORDER BY x.key
               FOR UPDATE OF x SKIP LOCKED) s;
    WITH doomed AS (
        SELECT x.queue, x.msg_id,
               (x.queue, x.msg_id) IN (SELECT o.queue, o.msg_id FROM unnest(orphan_queues, orphan_ids) AS o(queue, msg_id))
                   AS orphan
          FROM lockgate.leases x JOIN unnest(keys) AS sk(key) ON sk.key = x.key
         WHERE x.expires_at < at
         ORDER BY x.queue, x.msg_id
           FOR UPDATE OF x SKIP LOCKED),
    gone AS (
        DELETE FROM lockgate.leases l USING doomed d
         WHERE l.queue = d.queue AND l.msg_id = d.msg_id
        RETURNING l.key, d.orphan),
    given AS (
        UPDATE lockgate.semaphores s SET value = s.value - g.n, updated_at = now()
          FROM (SELECT gone.key, count(*)::integer AS n FROM gone GROUP BY gone.key) g
         WHERE s.key = g.key)
    SELECT count(*) FILTER (WHERE NOT gone.orphan), count(*) FILTER (WHERE gone.orphan)
      INTO expired, orphaned FROM gone;
    -- 2. Room is judged against the type's current limit (a raised limit frees room at once); a
    -- key whose type is gone or no longer limited is taken too, to dead-letter or release it.
    -- The oldest-waiting keys are chosen, then locked in key order, skipping held ones.
    FOR k IN
        WITH candidates AS (
            SELECT p.key FROM lockgate.parked p
              LEFT JOIN lockgate.semaphores s ON s.key = p.key
              LEFT JOIN lockgate.job_types jt ON jt.name = p.job_type
             WHERE s.key IS NULL OR jt.name IS NULL OR jt.concurrency_limit IS NULL OR s.value < jt.concurrency_limit
             GROUP BY p.key ORDER BY min(p.parked_at) LIMIT max_keys)
        SELECT c.key FROM candidates c
         WHERE NOT EXISTS (SELECT 1 FROM lockgate.semaphores s WHERE s.key = c.key)
            OR EXISTS (SELECT 1 FROM lockgate.semaphores s WHERE s.key = c.key FOR UPDATE SKIP LOCKED)
         ORDER BY c.key
    LOOP
        promotions := promotions || ARRAY(SELECT p FROM lockgate._promote(k.key) p);
    END LOOP;
    promoted := lockgate._send_promotions(promotions);
END $$;
