-- The concurrency sweep (dispatcher), in one transaction, costing the same with a million parked
-- jobs as with none:
-- 1. delete leases whose silence budget ran out and give their permits back, promoting the
--    parked jobs of those keys at once (a dead holder's permit is used within one sweep, G5;
--    found through the leases' expiry index, so thousands of held keys never delay it, H15). A
--    lease whose message no longer exists (removed outside lockgate, by pgmq.archive or
--    pgmq.delete) is no exception: its holder may still be running until its budget ends, so it
--    too is freed only when it expires (counted as orphaned). A lease whose job finished while
--    another transaction held its key's row (lockgate._release_leases) is expired at once, and
--    freed here as soon as the row is free (counted in neither). A lease whose key has no semaphore
--    row (only a bug, or a hand edit past migration 19's guards, makes one; docs/design.md §61) is
--    deleted once expired, with no permit to give back: no row counts it. A lapsed holder's `sql`
--    statement still running on a backend that carries its job's mark (sql/046_statements.sql)
--    is ended first, and its lease kept for a later pass if it cannot be (docs/design.md §100);
-- 2. repair: promote parked jobs of keys that can take a permit although nothing released one
--    (every release promotes in its own transaction, so such keys are rare: a raised or removed
--    limit, a type or queue gone, a permit given back at a claim that re-keyed its job, a parked
--    row a promotion skipped because another transaction held it). Each pass looks at the next
--    LEAST(max_keys, 256) keys with parked jobs after the last one looked at (a loose scan of the
--    parked jobs' key index, one probe per key, wrapping around), so every key is looked at
--    within (keys / 256) passes. When the policies or queues change (their fingerprint in
--    lockgate.sweep_state), passes instead take every key that can promote now, oldest-waiting
--    first, at most max_keys per pass, until one finds fewer (lockgate._sweep_candidates): a
--    raised limit frees room at the next sweep;
-- 3. give back the unique keys of while_executing runs whose delivery lapsed
--    (lockgate._release_lapsed_runs).
-- Returns counts. now_override pins the clock for tests; NULL means the database's clock.
--
-- Every statement but the policy-change pass (lockgate._sweep_candidates) reaches the key tables
-- only through the expired leases' expiry index, the keys and the leases found there, or the
-- cursor's next keys (docs/design.md §61): its plan, made once per session and kept, with
-- sequential scans, hash and merge joins off, reads what it names however few keys there were
-- when it was made. Never waits for a lock (H28, H31):
-- a key's semaphore row or a lease that another transaction holds (an open producer transaction,
-- a completion, a claim renewing the lease) is skipped and taken by a later pass; so one held key
-- can never stall the sweep of every other key; a second sweep running at once skips the repair
-- (lockgate.sweep_state's row). Locks, each skipping what another transaction holds: semaphore
-- rows of the expired leases' keys in key order, then those keys' expired leases (a lease a claim
-- or heartbeat just renewed is re-checked and kept), then parked rows; then the repair's semaphore
-- rows, in key order. Completions lock leases before semaphore rows, the reverse; it cannot
-- deadlock only because every lock here skips rather than waits. (A key with parked jobs and no
-- semaphore row would be created by its promotion, which waits for a producer inserting the same
-- row; only a hand edit past migration 19's guards makes one.) Callers: the sweep service every
-- sweep_interval, operators.
CREATE OR REPLACE FUNCTION lockgate.sweep(max_keys integer DEFAULT 1000, now_override timestamptz DEFAULT NULL,
    OUT expired integer, OUT orphaned integer, OUT promoted integer)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET jit = off AS $$
DECLARE
    at timestamptz := COALESCE(now_override, clock_timestamp());
    e_keys text[];
    e_queues text[];
    e_ids bigint[];
    e_tids tid[];
    keys text[];
    take boolean[];
    tids tid[];
    gone_queues text[];
    gone_ids bigint[];
    n_gone integer;
    n_finished integer;
    counts integer[];
    q record;
    promotions lockgate.promotion[] := '{}';
    st lockgate.sweep_state;
    fingerprint text;
    window_size integer := GREATEST(LEAST(max_keys, 256), 1);
    looked text[];
    candidates text[];
    k record;
    -- The marks of the expired leases' statements (sql/046_statements.sql), those of any running
    -- backend, and those of statements that could not be ended.
    e_marks text[];
    mine boolean[];
    marks text[];
    kept text[] := '{}';
BEGIN
    -- 1. The expired leases, read from the expiry index alone (no order is asked of the table,
    -- so no plan walks another index for one); their keys made distinct and sorted in memory.
    SELECT array_agg(l.key), array_agg(l.queue), array_agg(l.msg_id), array_agg(l.ctid)
      INTO e_keys, e_queues, e_ids, e_tids
      FROM lockgate.leases l WHERE l.expires_at < at;
    keys := ARRAY(SELECT DISTINCT e.key FROM unnest(e_keys) AS e(key) ORDER BY e.key);
    -- Each key's row locked, in key order. take[i] says what becomes of keys[i]'s expired
    -- leases: true, its row is locked here; false, it has no row (its leases are deleted with
    -- nothing to give back); NULL, another transaction holds its row (left for a later pass).
    take := lockgate._take_keys(keys);
    -- The expired leases of the keys taken (a key's place in keys is its dense rank), each
    -- locked unless another transaction holds it, found again at the row address it was read at:
    -- a TID scan, the one plan no table size changes (probed by key, or even by primary key, a
    -- plan made on few leases read every expired lease through the expiry index for each one).
    -- Under the lock the lease is checked again: one renewed since it was read is either no
    -- longer at that address (an update writes a new version) or re-checked by the lock and kept.
    -- An address is not reused within the call (the calling statement's snapshot keeps the old
    -- version from being vacuumed); the queue, message and key are checked all the same.
    -- Then how many each key with a row gives back, and the leases deleted by the addresses now
    -- locked: rows this transaction holds cannot move or be deleted by another, so every row is
    -- deleted.
    WITH held AS MATERIALIZED (
        SELECT e.key, take[e.r] AS mine, x.tid,
               CASE WHEN x.finished_at IS NULL THEN lockgate._statement_tag(e.queue, e.msg_id) END AS mark
          FROM (SELECT u.*, dense_rank() OVER (ORDER BY u.key)::integer AS r
                  FROM unnest(e_keys, e_queues, e_ids, e_tids) AS u(key, queue, msg_id, tid)) e
         CROSS JOIN LATERAL (SELECT x.ctid AS tid, x.finished_at FROM lockgate.leases x
                              WHERE x.ctid = e.tid AND x.queue = e.queue AND x.msg_id = e.msg_id AND x.key = e.key
                                AND x.expires_at < at
                              OFFSET 0 FOR UPDATE SKIP LOCKED) x
         WHERE take[e.r] IS NOT NULL)
    SELECT array_agg(h.tid), array_agg(h.key), array_agg(h.mine), array_agg(h.mark)
      INTO tids, e_keys, mine, e_marks
      FROM held h;
    -- A lapsed holder's `sql` statement may still run on the server (its lockgate frozen or cut
    -- off): its backend is ended before the permit is given back, and a lease whose statement
    -- cannot be ended is kept, for a later pass (docs/design.md §100). The marks are read after
    -- the leases were locked (sql/046_statements.sql); there are none, almost always.
    IF cardinality(array_remove(e_marks, NULL)) > 0 THEN
        marks := lockgate._statement_marks();
        IF marks && e_marks THEN
            kept := lockgate._end_statements(ARRAY(SELECT m FROM unnest(e_marks) AS m WHERE m = ANY (marks)));
        END IF;
    END IF;
    WITH live AS MATERIALIZED (
        SELECT h.* FROM unnest(tids, e_keys, mine, e_marks) AS h(tid, key, mine, mark)
         WHERE h.mark IS NULL OR NOT h.mark = ANY (kept)),
    per_key AS (
        SELECT h.key, count(*)::integer AS n FROM live h WHERE h.mine GROUP BY h.key)
    SELECT (SELECT array_agg(h.tid) FROM live h),
           (SELECT array_agg(c.key ORDER BY c.key) FROM per_key c),
           (SELECT array_agg(c.n ORDER BY c.key) FROM per_key c)
      INTO tids, keys, counts;
    WITH gone AS (
        DELETE FROM lockgate.leases l WHERE l.ctid = ANY (tids) RETURNING l.queue, l.msg_id, l.finished_at)
    SELECT array_agg(gone.queue) FILTER (WHERE gone.finished_at IS NULL),
           array_agg(gone.msg_id) FILTER (WHERE gone.finished_at IS NULL),
           count(*)::integer, count(*) FILTER (WHERE gone.finished_at IS NOT NULL)::integer
      INTO gone_queues, gone_ids, n_gone, n_finished FROM gone;
    IF n_gone IS DISTINCT FROM COALESCE(cardinality(tids), 0) THEN
        RAISE EXCEPTION 'lockgate: % expired leases locked, % deleted', cardinality(tids), n_gone;
    END IF;
    -- Leases of finished jobs (their completion found the key's row held, sql/015_concurrency.sql
    -- lockgate._release_leases) are neither expired nor orphaned: their permits just go back. Which
    -- of the others had lost their message (for the count), one probe of the queue's table each.
    orphaned := 0;
    FOR q IN SELECT DISTINCT g.queue FROM unnest(gone_queues) AS g(queue)
              WHERE g.queue IN (SELECT lockgate._live_queues()) LOOP
        EXECUTE format(
            'SELECT $3 + count(*)::integer FROM unnest($1, $2) AS g(queue, msg_id)
              WHERE g.queue = $4
                AND NOT EXISTS (SELECT 1 FROM %s m WHERE m.msg_id = g.msg_id)',
            lockgate._queue_table(q.queue, 'q'))
          INTO orphaned USING gone_queues, gone_ids, orphaned, q.queue;
    END LOOP;
    expired := n_gone - n_finished - orphaned;
    -- Given back and promoted in one step, on the semaphore rows locked above; a key with no row
    -- has nothing to give back.
    IF keys IS NOT NULL THEN
        promotions := lockgate._promote_keys(keys, counts);
    END IF;
    -- 2. The repair, unless another sweep is running it.
    SELECT * INTO st FROM lockgate.sweep_state s WHERE s.singleton FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        fingerprint := md5(COALESCE((SELECT string_agg(t.name || '=' || COALESCE(t.concurrency_limit::text, '-'), ','
                                                       ORDER BY t.name) FROM lockgate.job_types t), '')
                           || '|' || COALESCE((SELECT string_agg(l.q, ',') FROM lockgate._live_queues() AS l(q)), ''));
        IF st.full_scan OR st.policies IS DISTINCT FROM fingerprint THEN
            candidates := lockgate._sweep_candidates(max_keys);
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
            -- Those whose next job can be promoted now (or dead-lettered, or released: its type
            -- or queue is gone, or its type no longer limited), each looked up by probes of its
            -- own (lockgate._next_parked_room).
            candidates := ARRAY(
                SELECT l.key FROM unnest(looked) WITH ORDINALITY AS l(key, o)
                 CROSS JOIN LATERAL lockgate._next_parked_room(l.key) r
                 WHERE r.room
                 ORDER BY l.o);
            UPDATE lockgate.sweep_state s
               SET cursor_key = CASE WHEN cardinality(looked) < window_size THEN NULL ELSE looked[cardinality(looked)] END
             WHERE s.singleton;
        END IF;
        -- Locked in key order, skipping held ones; a key with no row is taken too (its first
        -- promotion creates the row).
        candidates := ARRAY(SELECT u.key FROM unnest(candidates) AS u(key) ORDER BY u.key);
        FOR k IN
            SELECT c.key FROM unnest(candidates, lockgate._take_keys(candidates)) AS c(key, taken)
             WHERE c.taken IS NOT NULL
        LOOP
            promotions := promotions || ARRAY(SELECT p FROM lockgate._promote(k.key) p);
        END LOOP;
    END IF;
    promoted := lockgate._send_promotions(promotions);
    -- 3. The keys of while_executing runs whose delivery lapsed (sql/016_uniqueness.sql).
    PERFORM lockgate._release_lapsed_runs();
END $$;

-- The keys whose parked jobs can be promoted now, oldest-waiting first, at most max_keys: for a
-- sweep after the policies or queues changed (a raised limit, a type or queue gone). Room is
-- judged against the type's current limit (a raised limit frees room at once), and then, for the
-- keys that pass, as lockgate._promote judges it (lockgate._next_parked_room: the key's next job,
-- and its holders' limits on a key types share); a key whose type is gone or no longer limited,
-- or whose queue is gone, is taken too, to dead-letter or release it (one whose table was made
-- again behind lockgate's back is taken as well, and _promote leaves its jobs parked until
-- lockgate adopts the table). The keys are first filtered by a join over every parked job
-- (lockgate._parked_keys_to_judge); the exact judgement is made in age order, after the sort,
-- until max_keys pass (OFFSET 0 keeps it from being pushed below the sort, onto every key). It reads
-- every parked job, so it runs with the planner's own choices (lockgate.sweep turns sequential
-- scans, hash and merge joins off for its other statements); a SQL function with settings of its
-- own (which also keep it from being inlined), planned at each call.
CREATE OR REPLACE FUNCTION lockgate._sweep_candidates(max_keys integer)
RETURNS text[] LANGUAGE sql STABLE
SET plan_cache_mode = auto SET enable_seqscan = on SET enable_hashjoin = on SET enable_mergejoin = on AS $$
    SELECT ARRAY(
        SELECT c.key
          FROM (SELECT m.key FROM lockgate._parked_keys_to_judge() m ORDER BY m.oldest OFFSET 0) c
         CROSS JOIN LATERAL lockgate._next_parked_room(c.key) r
         WHERE r.room
         LIMIT max_keys)
$$;

-- Locks the semaphore rows of keys (distinct, sorted), each by a probe of its own in their order
-- (a lateral subquery no plan can turn into a walk of the table, §61), skipping any row another
-- transaction holds: never waits. Returns, for each key in order, true when its row is locked
-- here, false when it has no row, NULL when another transaction holds it. Callers: lockgate.sweep
-- (the expired leases' keys, the repair's candidates).
CREATE OR REPLACE FUNCTION lockgate._take_keys(keys text[])
RETURNS boolean[] LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET jit = off AS $$
BEGIN
    RETURN ARRAY(
        SELECT CASE WHEN m.locked THEN true WHEN p.present IS NULL THEN false END
          FROM unnest(keys) WITH ORDINALITY AS g(key, o)
          LEFT JOIN LATERAL (SELECT true AS locked FROM lockgate.semaphores x WHERE x.key = g.key
                              OFFSET 0 FOR UPDATE SKIP LOCKED) m ON true
          LEFT JOIN LATERAL (SELECT true AS present FROM lockgate.semaphores x WHERE x.key = g.key AND m.locked IS NULL
                              OFFSET 0) p ON true
         ORDER BY g.o);
END $$;
