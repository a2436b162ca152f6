-- The concurrency sweep (dispatcher), in one transaction, costing the same with a million parked
-- jobs as with none:
-- 1. delete leases whose silence budget ran out and give their permits back, promoting the
--    parked jobs of those keys at once (a dead holder's permit is used within one sweep, G5;
--    found through the leases' expiry index, so thousands of held keys never delay it, H15). A
--    lease whose message no longer exists (removed outside lockgate, by pgmq.archive or
--    pgmq.delete) is no exception: its holder may still be running until its budget ends, so it
--    too is freed only when it expires (counted as orphaned);
-- 2. repair: promote parked jobs of keys that can take a permit although nothing released one
--    (every release promotes in its own transaction, so such keys are rare: a raised or removed
--    limit, a type or queue gone, a permit given back at a claim that re-keyed its job, a parked
--    row a promotion skipped because another transaction held it). Each pass looks at the next
--    LEAST(max_keys, 256) keys with parked jobs after the last one looked at (a loose scan of the
--    parked jobs' key index, one probe per key, wrapping around), so every key is looked at
--    within (keys / 256) passes. When the policies or queues change (their fingerprint in
--    lockgate.sweep_state), passes instead take every key that can promote now, oldest-waiting
--    first, at most max_keys per pass, until one finds fewer: a raised limit frees room at the
--    next sweep.
-- Returns counts. now_override pins the clock for tests; NULL means the database's clock.
--
-- Never waits for a lock (H28, H31): a key's semaphore row or a lease that another transaction
-- holds (an open producer transaction, a completion, a claim renewing the lease) is skipped and
-- taken by a later pass; so one held key can never stall the sweep of every other key; a second
-- sweep running at once skips the repair (lockgate.sweep_state's row). Locks, in the order every
-- path keeps: semaphore rows in key order (SKIP LOCKED), then the expired lease rows of those
-- keys (SKIP LOCKED; a lease a claim or heartbeat just renewed is re-checked and kept), then
-- parked rows (SKIP LOCKED); then the repair's semaphore rows, in key order (SKIP LOCKED).
-- Callers: the sweep service every sweep_interval, operators.
CREATE OR REPLACE FUNCTION lockgate.sweep(max_keys integer DEFAULT 1000, now_override timestamptz DEFAULT NULL,
    OUT expired integer, OUT orphaned integer, OUT promoted integer)
LANGUAGE plpgsql AS $$
DECLARE
    at timestamptz := COALESCE(now_override, clock_timestamp());
    keys text[];
    counts integer[];
    orphan_queues text[] := '{}';
    orphan_ids bigint[] := '{}';
    k record;
    q record;
    promotions lockgate.promotion[] := '{}';
    st lockgate.sweep_state;
    fingerprint text;
    window_size integer := GREATEST(LEAST(max_keys, 256), 1);
    looked text[];
    candidates text[];
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
    per_key AS (
        SELECT gone.key, count(*)::integer AS n, count(*) FILTER (WHERE NOT gone.orphan) AS e,
               count(*) FILTER (WHERE gone.orphan) AS o
          FROM gone GROUP BY gone.key)
    SELECT COALESCE(sum(p.e), 0)::integer, COALESCE(sum(p.o), 0)::integer,
           array_agg(p.key ORDER BY p.key), array_agg(p.n ORDER BY p.key)
      INTO expired, orphaned, keys, counts FROM per_key p;
    IF keys IS NOT NULL THEN
        -- Given back and promoted in one step, on the semaphore rows locked above.
        promotions := lockgate._promote_keys(keys, counts);
    END IF;
    -- 2. The repair, unless another sweep is running it.
    SELECT * INTO st FROM lockgate.sweep_state s WHERE s.singleton FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        fingerprint := md5(COALESCE((SELECT string_agg(t.name || '=' || COALESCE(t.concurrency_limit::text, '-'), ','
                                                       ORDER BY t.name) FROM lockgate.job_types t), '')
                           || '|' || COALESCE((SELECT string_agg(l.q, ',') FROM lockgate._live_queues() AS l(q)), ''));
        IF st.full_scan OR st.policies IS DISTINCT FROM fingerprint THEN
            -- Room is judged against the type's current limit (a raised limit frees room at
            -- once); a key whose type is gone or no longer limited is taken too, to dead-letter or
            -- release it. The oldest-waiting keys first.
            candidates := ARRAY(
                SELECT p.key FROM lockgate.parked p
                  LEFT JOIN lockgate.semaphores s ON s.key = p.key
                  LEFT JOIN lockgate.job_types jt ON jt.name = p.job_type
                 WHERE s.key IS NULL OR jt.name IS NULL OR jt.concurrency_limit IS NULL OR s.value < jt.concurrency_limit
                    OR p.queue NOT IN (SELECT lockgate._live_queues())
                 GROUP BY p.key ORDER BY min(p.parked_at) LIMIT max_keys);
            UPDATE lockgate.sweep_state s SET full_scan = cardinality(candidates) >= max_keys, policies = fingerprint
             WHERE s.singleton;
        ELSE
            -- The next keys with parked jobs after the cursor, one index probe each.
            looked := ARRAY(
                WITH RECURSIVE w(key) AS (
                    (SELECT p.key FROM lockgate.parked p WHERE p.key > COALESCE(st.cursor_key, '') ORDER BY p.key LIMIT 1)
                    UNION ALL
                    SELECT (SELECT p.key FROM lockgate.parked p WHERE p.key > w.key ORDER BY p.key LIMIT 1)
                      FROM w WHERE w.key IS NOT NULL)
                SELECT w.key FROM w WHERE w.key IS NOT NULL LIMIT window_size);
            candidates := ARRAY(
                SELECT l.key FROM unnest(looked) AS l(key)
                  LEFT JOIN lockgate.semaphores s ON s.key = l.key
                 CROSS JOIN LATERAL (SELECT x.job_type, x.queue FROM lockgate.parked x WHERE x.key = l.key
                                      ORDER BY x.priority, x.id LIMIT 1) head
                  LEFT JOIN lockgate.job_types jt ON jt.name = head.job_type
                 WHERE s.key IS NULL OR jt.name IS NULL OR jt.concurrency_limit IS NULL OR s.value < jt.concurrency_limit);
            UPDATE lockgate.sweep_state s
               SET cursor_key = CASE WHEN cardinality(looked) < window_size THEN NULL ELSE looked[cardinality(looked)] END
             WHERE s.singleton;
        END IF;
        -- Locked in key order, skipping held ones.
        FOR k IN
            SELECT c.key FROM unnest(candidates) AS c(key)
             WHERE NOT EXISTS (SELECT 1 FROM lockgate.semaphores s WHERE s.key = c.key)
                OR EXISTS (SELECT 1 FROM lockgate.semaphores s WHERE s.key = c.key FOR UPDATE SKIP LOCKED)
             ORDER BY c.key
        LOOP
            promotions := promotions || ARRAY(SELECT p FROM lockgate._promote(k.key) p);
        END LOOP;
    END IF;
    promoted := lockgate._send_promotions(promotions);
END $$;
