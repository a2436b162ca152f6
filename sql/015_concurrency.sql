-- Concurrency limits: the guarded acquire, leases, parking and promotion. Every path that takes
-- a permit — enqueue, promotion at completion, promotion by the sweep, re-acquire at claim —
-- goes through lockgate._acquire or lockgate._promote_keys, which hold the key's semaphore row
-- lock and increment value only while value < limit, the least of the admitted job's type's and
-- its holders' types' limits (G3; types sharing an explicit key, docs/design.md §109). Every path
-- that gives one back deletes its own lease row and decrements by exactly the rows it deleted,
-- so value = live leases at every commit (G2, H2, H7).
-- Lock order: lease rows, then semaphore rows in key order, then parked rows.

-- A key of a job (concurrency or uniqueness): explicit if given, else the type's name, plus the
-- values at the key paths (dotted, e.g. 'account.id'). PL/pgSQL, which keeps its statement's
-- plan for the session: as a SQL function with a subquery, never inlined, it was planned again
-- in every transaction that enqueued a limited or unique job.
CREATE OR REPLACE FUNCTION lockgate._key_of(type_name text, paths text[], args jsonb, explicit text)
RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF explicit IS NOT NULL THEN
        RETURN explicit;
    ELSIF paths IS NULL OR cardinality(paths) = 0 THEN
        RETURN type_name;
    END IF;
    RETURN type_name || ':' || (SELECT jsonb_agg(COALESCE(args #> string_to_array(u.p, '.'), 'null') ORDER BY u.o)
                                  FROM unnest(paths) WITH ORDINALITY u(p, o))::text;
END $$;

-- The concurrency key of a job.
CREATE OR REPLACE FUNCTION lockgate._concurrency_key(jt lockgate.job_types, args jsonb, explicit text)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT lockgate._key_of(jt.name, jt.concurrency_key, args, explicit)
$$;

-- The floor of every lease's silence budget: twice the heartbeat interval (H10). The one row
-- by its key, so that a caller running with sequential scans off (a queue's steps) reads it by
-- index rather than under the planner's penalty (which brought in JIT compilation, 20 ms).
-- PL/pgSQL, which keeps its statement's plan for the session: a SQL function with a subquery is
-- never inlined, and was planned again in every transaction that called it (30-60 us).
CREATE OR REPLACE FUNCTION lockgate._lease_floor_ms()
RETURNS bigint LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN 2 * COALESCE((SELECT s.heartbeat_interval_ms FROM lockgate.settings s WHERE s.singleton), 5000);
END $$;

-- A lease's silence budget: the type's duration, floored. A plain expression, so the planner
-- inlines it; statements over many leases pass the floor as (SELECT lockgate._lease_floor_ms()),
-- which is read once per statement rather than once per row. At most 100 years: a duration
-- stored before define_job_type bounded it must not fail the claim or enqueue that adds it to
-- the clock.
CREATE OR REPLACE FUNCTION lockgate._lease_interval(duration_ms bigint, floor_ms bigint)
RETURNS interval LANGUAGE sql IMMUTABLE AS $$
    SELECT make_interval(secs => LEAST(GREATEST(duration_ms, floor_ms), 3155760000000) / 1000.0)
$$;

CREATE OR REPLACE FUNCTION lockgate._lease_interval(duration_ms bigint)
RETURNS interval LANGUAGE sql STABLE AS $$
    SELECT lockgate._lease_interval(duration_ms, lockgate._lease_floor_ms())
$$;

-- What the holders of key bind every admission to: lim, the least of their types' current
-- limits (a holder whose type is gone or no longer limited binds nothing; one taken before
-- migration 27, whose type no lease recorded, binds the key's recorded limit), NULL when none
-- binds; and sole_type, the one type every holder is of, when each has a lease naming it (NULL
-- otherwise), with which a key whose holders were of several types returns to the one-statement
-- admission once they are of one again. holders is how many permits of the key are held: a
-- holder promoted in the caller's transaction has no lease row until its promotion is sent
-- (lockgate._send_promotions, after every key is done), and while the key's lease rows are
-- fewer, the key's recorded limit binds too (every admission records a limit no looser than the
-- one it was made under) and no sole type is known. Read by a path that holds the key's row
-- locked, and only for a key whose holders are not all of the admitted job's type
-- (lockgate.semaphores.sole_type): one probe of the key's leases. Volatile, so that its query
-- sees every lease committed before the caller locked the row.
CREATE OR REPLACE FUNCTION lockgate._holders(key text, holders integer, OUT lim integer, OUT sole_type text)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
BEGIN
    SELECT LEAST(min(COALESCE(t.concurrency_limit, CASE WHEN l.key IS NOT NULL AND l.job_type IS NULL THEN s.lim END)),
                 CASE WHEN count(l.key) < holders THEN min(s.lim) END),
           CASE WHEN count(l.key) = holders AND count(l.job_type) = holders AND count(DISTINCT l.job_type) = 1
                THEN min(l.job_type) END
      INTO lim, sole_type
      FROM lockgate.semaphores s
      LEFT JOIN lockgate.leases l ON l.key = s.key
      LEFT JOIN lockgate.job_types t ON t.name = l.job_type
     WHERE s.key = _holders.key;
END $$;

-- Whether the next parked job of key (best priority, then oldest) can be promoted now, as
-- lockgate._promote judges it: the key has no row yet, the job's type is gone or no longer
-- limited or its queue is gone (to dead-letter or release it), or the key's holders are fewer
-- than the least of its type's current limit and, where they are not all of that type, their
-- types' limits (design §109). held and lim: the count and the limit it judged by. No row when
-- nothing is parked. Outside a promotion's transaction, so a key's lease rows are all its
-- holders. A SQL function returning a set, so that the planner inlines it into its caller: the
-- queues are listed once per statement, and each key costs its probes alone (its next parked
-- job, its row, its type and, only where the holders are of another type, its leases), where a
-- PL/pgSQL call cost 32 us a key (review helper-126 F1). Callers: the sweep's repair (its
-- candidates: judged by the job's own limit alone, keys held by a stricter type's jobs were
-- picked at every pass, and kept a key with room from being looked at, review helper-124 F3),
-- lockgate doctor (parked_with_room).
CREATE OR REPLACE FUNCTION lockgate._next_parked_room(key text)
RETURNS TABLE (room boolean, held integer, lim integer) LANGUAGE sql STABLE AS $$
    SELECT s.key IS NULL OR jt.name IS NULL OR jt.concurrency_limit IS NULL
           OR head.queue NOT IN (SELECT lockgate._live_queues())
           OR s.value < LEAST(jt.concurrency_limit, h.lim),
           COALESCE(s.value, 0), LEAST(jt.concurrency_limit, h.lim)
      FROM (SELECT x.job_type, x.queue FROM lockgate.parked x WHERE x.key = $1
             ORDER BY x.priority, x.id LIMIT 1) head
      LEFT JOIN lockgate.semaphores s ON s.key = $1
      LEFT JOIN lockgate.job_types jt ON jt.name = head.job_type
      LEFT JOIN LATERAL (SELECT min(COALESCE(t.concurrency_limit, CASE WHEN l.job_type IS NULL THEN s.lim END)) AS lim
                           FROM lockgate.leases l LEFT JOIN lockgate.job_types t ON t.name = l.job_type
                          WHERE l.key = $1 AND s.value > 0 AND s.sole_type IS DISTINCT FROM head.job_type) h ON true
$$;

-- The keys with parked jobs that lockgate._next_parked_room may find room in, with the time the
-- oldest of them was parked: a key with no row, one with a parked job whose type is gone or no
-- longer limited or whose queue is gone, or one with a parked job whose type's limit its holders
-- do not fill, unless they are all of one type whose own limit they fill (the common wait of a key
-- types share, a looser type's job behind a stricter type's holders, left out by the join alone:
-- judged key by key, 100,000 such keys took the sweep's full scan from 0.2 to 3.3 s, and past the
-- sweep's statement timeout, review helper-126 F1). One join over every parked job. A SQL
-- function returning a set, inlined into its callers: the sweep's full scan
-- (lockgate._sweep_candidates), lockgate doctor (parked_with_room).
CREATE OR REPLACE FUNCTION lockgate._parked_keys_to_judge()
RETURNS TABLE (key text, oldest timestamptz) LANGUAGE sql STABLE AS $$
    SELECT p.key, min(p.parked_at) FROM lockgate.parked p
      LEFT JOIN lockgate.semaphores s ON s.key = p.key
      LEFT JOIN lockgate.job_types jt ON jt.name = p.job_type
      LEFT JOIN lockgate.job_types st ON st.name = s.sole_type
     WHERE s.key IS NULL OR jt.name IS NULL OR jt.concurrency_limit IS NULL
        OR (s.value < jt.concurrency_limit
            AND (s.sole_type IS NULL OR s.value < COALESCE(st.concurrency_limit, 2147483647)))
        OR p.queue NOT IN (SELECT lockgate._live_queues())
     GROUP BY p.key
$$;

-- Takes one permit of key for a job of type job_type, limited to lim; true when taken. Taken
-- while the key has fewer holders than lim and than every holder's own type's limit: types that
-- share a key (an explicit key several types name) are each admitted under the strictest limit
-- among the key's holders, so a job of a type limited to 1 never runs beside another's
-- (docs/design.md §109). The common case is one statement: the key is empty, or its holders are
-- all of job_type (sole_type), and lim alone decides. Else the holders' limit is read from their
-- leases, under the row lock (and sole_type recorded again if they all turn out to be of
-- job_type). The limit recorded is the one the admission was made under, so the
-- row's CHECK (value <= lim) stands behind both. Either way the key's semaphore row stays locked
-- until commit (a conflicting insert locks the row it meets, whether it updates it or not), so a
-- park decided here cannot race a release (H6).
CREATE OR REPLACE FUNCTION lockgate._acquire(key text, lim integer, job_type text)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    taken integer;
    held integer;
    binding integer;
    alone text;
BEGIN
    INSERT INTO lockgate.semaphores AS s (key, lim, value, sole_type)
    VALUES (_acquire.key, _acquire.lim, 1, _acquire.job_type)
    ON CONFLICT ON CONSTRAINT semaphores_pkey DO UPDATE
       SET value = s.value + 1, lim = EXCLUDED.lim, sole_type = EXCLUDED.sole_type, updated_at = now()
     WHERE s.value < EXCLUDED.lim AND (s.value = 0 OR s.sole_type = EXCLUDED.sole_type)
    RETURNING 1 INTO taken;
    IF taken IS NOT NULL THEN
        RETURN true;
    END IF;
    -- Refused by the one statement: full under lim (whoever holds it), or held by jobs of
    -- another type, or of several.
    SELECT s.value INTO held FROM lockgate.semaphores s WHERE s.key = _acquire.key;
    IF held >= lim THEN
        RETURN false;
    END IF;
    SELECT h.lim, h.sole_type INTO binding, alone FROM lockgate._holders(key, held) h;
    binding := LEAST(lim, binding);
    IF held >= binding THEN
        RETURN false;
    END IF;
    UPDATE lockgate.semaphores s
       SET value = s.value + 1, lim = binding, updated_at = now(),
           sole_type = CASE WHEN alone = _acquire.job_type THEN alone END
     WHERE s.key = _acquire.key;
    RETURN true;
END $$;

-- Binds a taken permit to its message, naming the job's type (what lockgate._holders
-- reads). The lease covers the delay before the message is visible (H9), then the silence
-- budget. PL/pgSQL, for its plan kept for the session (a SQL function's INSERT was planned again
-- in every transaction).
CREATE OR REPLACE FUNCTION lockgate._add_lease(key text, queue text, msg_id bigint, visible_at timestamptz, duration_ms bigint, job_type text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lockgate.leases (queue, msg_id, key, duration_ms, expires_at, job_type)
    VALUES (_add_lease.queue, _add_lease.msg_id, _add_lease.key, _add_lease.duration_ms,
            GREATEST(_add_lease.visible_at, clock_timestamp()) + lockgate._lease_interval(_add_lease.duration_ms),
            _add_lease.job_type);
END $$;

-- Revision 115's forms of the two above, which named no type: kept for the sessions still
-- running that revision's functions while a migrate replaces them. An enqueue, claim or promotion
-- of that revision in progress when the migrate committed calls them after it, and failed with
-- 42883 when revision 116 dropped them (review helper-141 F1). A permit taken, or a lease
-- written, without a type counts under the key's recorded limit, as those taken before
-- migration 27 do (lockgate._holders).
CREATE OR REPLACE FUNCTION lockgate._acquire(key text, lim integer)
RETURNS boolean LANGUAGE sql AS $$
    SELECT lockgate._acquire(key, lim, NULL::text)
$$;

CREATE OR REPLACE FUNCTION lockgate._add_lease(key text, queue text, msg_id bigint, visible_at timestamptz, duration_ms bigint)
RETURNS void LANGUAGE sql AS $$
    SELECT lockgate._add_lease(key, queue, msg_id, visible_at, duration_ms, NULL::text)
$$;

-- Ends the leases of the given messages of one queue, whose jobs have just ended (completed,
-- dead-lettered, cancelled) in the caller's transaction, after the fenced statement that decided
-- they were the caller's to end: gives their permits back and promotes parked jobs of each key
-- released. Returns how many jobs it promoted. Never waits for a key's semaphore row that another
-- transaction holds (H28): each key's row is taken only if it is free (lockgate._take_keys), and a
-- held one is tried again every millisecond for up to 5 ms (a racing completion or sweep holds a
-- row only until its commit). A key still held after that (an open producer transaction that
-- enqueued a job of the key holds its row until it commits) keeps its leases, marked finished
-- (finished_at; expires_at brought forward to now): the permit stays held, never given back
-- early (G3), and the next transaction to hold the key's row gives it back before anything
-- else — this function for the keys it takes, an enqueue of the key
-- (lockgate._give_back_finished), the sweep — or, once this transaction has committed, a runtime
-- told so on the channel lockgate.finished. Waiting instead held the finished job's message row
-- and lease past the lease's end, and the job ran again when its worker gave the completion up
-- (docs/design.md §72). Retrying holds the rows already taken, but never waits in the lock
-- manager, so the order it holds them in cannot close a cycle.
--
-- Set-based: the same few statements whatever the batch. Its plans, and _promote_keys', are made
-- once per session, always the generic ones, and with sequential scans, hash and merge joins and
-- JIT off, as the queue's steps are: a plan made while the leases and semaphores were few and
-- freshly analysed read both tables whole, and kept doing so at every completion of the session
-- once they held thousands of keys (sequentially; _promote_keys, planned on few keys, still reads
-- every semaphore through its index: docs/design.md §60).
CREATE OR REPLACE FUNCTION lockgate._release_leases(queue text, msg_ids bigint[])
RETURNS integer LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET jit = off AS $$
DECLARE
    lease_tids tid[];
    lease_keys text[];
    keys text[];
    take boolean[];
    again boolean[];
    held text[];
    kept tid[];
    tries integer := 0;
    counts integer[];
BEGIN
    -- Each lease found by a probe of the primary key driven by its id (a lateral subquery no plan
    -- can turn into a walk of the table) and locked there, with its key; later deleted by its row
    -- address (a TID scan). Joined with the ids, a plan made on a few analysed leases walked the
    -- whole primary key and matched each lease against every id (20,000 leases read to complete
    -- one job), and with the ids as an array searched by the index, a plan made on never-analysed
    -- leases read every lease of the queue (docs/design.md §65). A lease a sweep deleted meanwhile
    -- is not found, and not counted; one renewed meanwhile is locked at its new version.
    SELECT array_agg(x.tid), array_agg(x.key) INTO lease_tids, lease_keys
      FROM unnest(msg_ids) AS r(msg_id)
     CROSS JOIN LATERAL (SELECT x.ctid AS tid, x.key FROM lockgate.leases x
                          WHERE x.queue = _release_leases.queue AND x.msg_id = r.msg_id
                         OFFSET 0 FOR UPDATE) x;
    IF lease_tids IS NULL THEN
        RETURN 0;
    END IF;
    keys := ARRAY(SELECT DISTINCT k.key FROM unnest(lease_keys) AS k(key) ORDER BY k.key);
    -- true: locked here; false: the key has no row (its leases go, with nothing to give back);
    -- NULL: another transaction holds it. Outside READ COMMITTED every key counts as held: a
    -- snapshot older than the key's row lock does not see a job parked behind the key since,
    -- and the permit went back past it, to the next enqueue (review helper-76). Such a caller
    -- leaves its permits finished, for a READ COMMITTED give-back (the runtime's, told below, the
    -- key's next holder's, or the sweep's).
    IF current_setting('transaction_isolation') = 'read committed' THEN
        take := lockgate._take_keys(keys);
    ELSE
        take := array_fill(NULL::boolean, ARRAY[cardinality(keys)]);
        tries := 5;
    END IF;
    WHILE array_position(take, NULL) IS NOT NULL AND tries < 5 LOOP
        tries := tries + 1;
        PERFORM pg_sleep(0.001);
        held := ARRAY(SELECT k.key FROM unnest(keys, take) AS k(key, t) WHERE k.t IS NULL ORDER BY k.key);
        again := lockgate._take_keys(held);
        take := ARRAY(SELECT COALESCE(k.t, a.t)
                        FROM unnest(keys, take) WITH ORDINALITY AS k(key, t, o)
                        LEFT JOIN unnest(held, again) AS a(key, t) ON a.key = k.key
                       ORDER BY k.o);
    END LOOP;
    IF array_position(take, NULL) IS NOT NULL THEN
        held := ARRAY(SELECT k.key FROM unnest(keys, take) AS k(key, t) WHERE k.t IS NULL);
        SELECT array_agg(l.tid) FILTER (WHERE l.key = ANY (held)),
               array_agg(l.tid) FILTER (WHERE NOT l.key = ANY (held))
          INTO kept, lease_tids
          FROM unnest(lease_tids, lease_keys) AS l(tid, key);
        UPDATE lockgate.leases l SET finished_at = clock_timestamp(), expires_at = LEAST(l.expires_at, clock_timestamp())
         WHERE l.ctid = ANY (kept);
        -- Once this commits, each runtime listening gives the permits back from a statement of
        -- its own, which waits for the key's row holding nothing else (lockgate_sql::
        -- give_back_finished): without it, a permit waited for the key's next enqueue or sweep.
        PERFORM pg_notify('lockgate.finished', k.key) FROM unnest(held) AS k(key);
    END IF;
    -- Deleted: these leases, and the finished leases other jobs of the keys taken here left
    -- behind, looked for only when there is one at all (one probe of the finished leases' index,
    -- almost always empty; a probe per key cost 5-10 us a job in a limited drain), each key's then
    -- by a probe of its own, skipping one a sweep is deleting.
    IF EXISTS (SELECT 1 FROM lockgate.leases x WHERE x.finished_at IS NOT NULL) THEN
        lease_tids := lease_tids || ARRAY(
            SELECT f.tid FROM unnest(keys, take) AS k(key, t)
             CROSS JOIN LATERAL (SELECT x.ctid AS tid FROM lockgate.leases x
                                  WHERE x.key = k.key AND x.finished_at IS NOT NULL
                                 OFFSET 0 FOR UPDATE SKIP LOCKED) f
             WHERE k.t);
    END IF;
    WITH gone AS (
        DELETE FROM lockgate.leases l WHERE l.ctid = ANY (lease_tids)
        RETURNING l.key)
    SELECT array_agg(g.key ORDER BY g.key), array_agg(g.n ORDER BY g.key) INTO keys, counts
      FROM (SELECT gone.key, count(*)::integer AS n FROM gone GROUP BY gone.key) g;
    IF keys IS NULL THEN
        RETURN 0;
    END IF;
    RETURN lockgate._send_promotions(lockgate._promote_keys(keys, counts));
END $$;

-- Before an enqueue takes a permit of key or parks behind it: the permits of the key's jobs
-- that finished while another transaction held its row (lockgate._release_leases) go back, and
-- the key's parked jobs are promoted into them, ahead of the job being enqueued, as a completion
-- would have done. One probe of the finished leases' index when there are none, as almost
-- always; else the key's row is locked (waiting, as the enqueue's own acquire would) and the
-- finished leases deleted, skipping one a sweep is deleting. SECURITY DEFINER, with a fixed
-- search path: a producer role may enqueue without the rights a completion needs (deleting
-- leases and parked jobs, writing other queues' messages), and what this does for it is what
-- the sweep would do (review of §72). Callers: lockgate._enqueue_one, and the runtime told of a
-- finished permit (lockgate_sql::give_back_finished, in a transaction of its own).
CREATE OR REPLACE FUNCTION lockgate._give_back_finished(key text)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
DECLARE
    n integer;
BEGIN
    -- Only in READ COMMITTED: with a snapshot older than the wait for the row, the promotion
    -- would not see a job the row's holder parked, and a later enqueue would take the permit
    -- ahead of it (review of §72, helper-74). Such a caller leaves the permit to the next holder.
    IF NOT EXISTS (SELECT 1 FROM lockgate.leases l WHERE l.key = _give_back_finished.key AND l.finished_at IS NOT NULL)
       OR current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN;
    END IF;
    PERFORM 1 FROM lockgate.semaphores s WHERE s.key = _give_back_finished.key FOR UPDATE;
    WITH gone AS (
        DELETE FROM lockgate.leases l
         WHERE l.ctid = ANY (ARRAY(SELECT x.ctid FROM lockgate.leases x
                                    WHERE x.key = _give_back_finished.key AND x.finished_at IS NOT NULL
                                      FOR UPDATE SKIP LOCKED))
        RETURNING 1)
    SELECT count(*) INTO n FROM gone;
    IF n > 0 THEN
        PERFORM lockgate._send_promotions(lockgate._promote_keys(ARRAY[key], ARRAY[n]));
    END IF;
END $$;

-- Gives back counts[i] permits of keys[i] (distinct keys whose semaphore rows the caller holds
-- locked) and promotes their parked jobs; returns what to send. The common case is three
-- statements: for every key whose next parked job's type is limited and whose queue exists, its
-- next parked jobs (best priority, then oldest) are picked and locked, as many as that type's
-- current limit leaves room for once the permits are back (or the limit of the key's remaining
-- holders, when they are not all of that type and one of theirs is stricter, docs/design.md
-- §109), less any among them of another type or bound for a queue that is gone; each semaphore
-- row is written once, with what was given back and what was taken (the CHECK on value <= lim
-- stands behind the arithmetic, G3), and not at all when the two cancel out under an unchanged
-- limit and type (a key handing its permit from the job that finished to the next one: the row
-- the caller holds locked is what orders every path, and updated_at, which idle-key reclamation
-- reads, matters only once the value is 0, which is always written); the picked jobs are
-- deleted and returned. A key that still has room afterwards (its next job's type is gone or no
-- longer limited, its queue is gone, or jobs of another type share its explicit key) goes through
-- _promote, one job at a time, which dead-letters what can never run (H16) and releases what no
-- longer needs a permit.
--
-- Every table is reached only from the keys or ids given (docs/design.md §60): the semaphores,
-- parked jobs and job types through lateral subqueries driven by the keys, which no plan can
-- turn into a walk of the table (a join was planned, on few keys, as a walk of the whole
-- semaphore index with a probe of the parked jobs for every row); the rows written and deleted
-- by their row addresses and ids (a TID scan, an index condition). Two derived sets are never joined
-- either (with hash and merge joins off, that is a nested loop, batch x batch): they are
-- gathered by aggregation, or matched by position.
CREATE OR REPLACE FUNCTION lockgate._promote_keys(keys text[], counts integer[])
RETURNS lockgate.promotion[] LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET jit = off AS $$
DECLARE
    promotions lockgate.promotion[];
    ids bigint[];
    durations bigint[];
    written text[];
    tids tid[];
    deltas integer[];
    lims integer[];
    soles text[];
    updated bigint;
    k text;
BEGIN
    WITH released AS MATERIALIZED (
        SELECT g.key, g.n, s.tid, s.value, s.lim, s.sole
          FROM unnest(keys, counts) AS g(key, n)
         CROSS JOIN LATERAL (SELECT x.ctid AS tid, x.value, x.lim, x.sole_type AS sole FROM lockgate.semaphores x
                              WHERE x.key = g.key OFFSET 0) s),
    -- The head type's limit, or the key's remaining holders' if they are not all of that type
    -- and one of theirs is stricter (lockgate._acquire, docs/design.md §109): a holder of a type
    -- limited to 1 admits no other job, of any type, beside it. A head type with no limit has no
    -- room here (its jobs go through _promote below, released without a permit; review
    -- helper-126 F2: the holders' limit stood in for its own, and it took a permit).
    room AS (
        SELECT g.key, g.lim AS held, g.sole AS held_sole, t.job_type, b.lim, t.duration_ms,
               b.lim - (g.value - g.n) AS n, b.sole
          FROM released g
         CROSS JOIN LATERAL (SELECT x.job_type, x.queue FROM lockgate.parked x WHERE x.key = g.key
                              ORDER BY x.priority, x.id LIMIT 1) head
         CROSS JOIN LATERAL (SELECT jt.name AS job_type, jt.concurrency_limit AS lim,
                                    jt.concurrency_duration_ms AS duration_ms
                               FROM lockgate.job_types jt WHERE jt.name = head.job_type OFFSET 0) t
         CROSS JOIN LATERAL (SELECT CASE WHEN g.value = g.n OR g.sole = t.job_type THEN t.lim
                                         WHEN t.lim IS NOT NULL THEN LEAST(t.lim, h.lim) END AS lim,
                                    CASE WHEN g.value = g.n OR g.sole = t.job_type OR h.sole_type = t.job_type
                                         THEN t.job_type END AS sole
                               FROM (SELECT x.lim, x.sole_type FROM lockgate._holders(g.key, g.value - g.n) x
                                      WHERE g.value <> g.n AND g.sole IS DISTINCT FROM t.job_type
                                     UNION ALL
                                     SELECT NULL, NULL WHERE g.value = g.n OR g.sole IS NOT DISTINCT FROM t.job_type) h) b
         WHERE b.lim > g.value - g.n
           AND head.queue IN (SELECT lockgate._live_queues())),
    -- The type and queue are checked after the LIMIT, not inside it: a filter there makes the
    -- planner expect almost no matching rows, and without statistics it then reads and sorts
    -- every parked job of the key instead of taking the first few from the index.
    picked AS (
        SELECT p.id, r.key, r.lim, r.duration_ms, r.sole
          FROM room r
         CROSS JOIN LATERAL (SELECT x.id, x.job_type, x.queue FROM lockgate.parked x
                              WHERE x.key = r.key
                              ORDER BY x.priority, x.id LIMIT r.n
                                FOR UPDATE SKIP LOCKED) p
         WHERE p.job_type = r.job_type
           AND p.queue IN (SELECT lockgate._live_queues())),
    -- Per key: its row, given back, taken, the limit to record and the one recorded, the type all
    -- its holders will be of (NULL: several) and the one recorded.
    change AS (
        SELECT u.key, (array_agg(u.tid) FILTER (WHERE u.tid IS NOT NULL))[1] AS tid, sum(u.n)::integer AS n,
               max(u.lim) AS lim, max(u.held) AS held, max(u.held_sole) AS held_sole,
               CASE WHEN bool_or(u.tid IS NULL) THEN max(u.sole) ELSE max(u.held_sole) END AS sole,
               bool_or(u.tid IS NULL) AS took
          FROM (SELECT g.key, g.tid, -g.n AS n, NULL::integer AS lim, g.lim AS held, g.sole AS held_sole, NULL AS sole
                  FROM released g
                UNION ALL
                SELECT picked.key, NULL, 1, picked.lim, NULL, NULL, picked.sole FROM picked) u
         GROUP BY u.key)
    -- A row is left unwritten when nothing of it changes: a key handing its permit from the job
    -- that finished to the next one of the same type. Handed between types, it is written all the
    -- same: a REPEATABLE READ transaction whose snapshot is older then meets the write when it
    -- locks the row (a serialization failure), instead of judging the holders from leases it
    -- cannot see.
    SELECT (SELECT array_agg(picked.id ORDER BY picked.id) FROM picked),
           (SELECT array_agg(picked.duration_ms ORDER BY picked.id) FROM picked),
           array_agg(c.key), array_agg(c.tid), array_agg(c.n), array_agg(c.lim), array_agg(c.sole)
      INTO ids, durations, written, tids, deltas, lims, soles
      FROM change c
     WHERE c.n <> 0 OR c.lim <> c.held OR c.sole IS DISTINCT FROM c.held_sole OR (c.took AND c.sole IS NULL);
    -- The rows that change, in one statement, each found by the row address read above (the
    -- caller holds the rows locked, so it cannot have moved): joined on the key, the planner
    -- may walk the whole index; on the address, only a probe of each is possible (a TID scan).
    IF written IS NOT NULL THEN
        UPDATE lockgate.semaphores s
           SET value = s.value + c.n, lim = COALESCE(c.lim, s.lim), sole_type = c.sole, updated_at = now()
          FROM unnest(tids, deltas, lims, written, soles) AS c(tid, n, lim, key, sole)
         WHERE s.ctid = c.tid AND s.key IS NOT DISTINCT FROM c.key;
        GET DIAGNOSTICS updated = ROW_COUNT;
        IF updated <> cardinality(written) THEN
            RAISE EXCEPTION 'lockgate: % semaphore rows to write, % written', cardinality(written), updated;
        END IF;
    END IF;
    IF ids IS NULL THEN
        promotions := '{}';
    ELSE
        -- The picked jobs, locked above, are all deleted here: the i-th by id is ids[i], whose
        -- lease lasts durations[i].
        WITH moved AS (
            DELETE FROM lockgate.parked x WHERE x.id = ANY (ids)
            RETURNING x.queue, x.run_at, x.args, x.headers, x.key, x.priority, x.id),
        numbered AS (
            SELECT m.*, row_number() OVER (ORDER BY m.id) AS i FROM moved m)
        SELECT array_agg(ROW(m.queue, GREATEST(m.run_at, clock_timestamp()), m.args, m.headers, m.key,
                             durations[m.i])::lockgate.promotion ORDER BY m.priority, m.id)
          INTO promotions FROM numbered m;
        IF cardinality(promotions) IS DISTINCT FROM cardinality(ids) THEN
            RAISE EXCEPTION 'lockgate: % parked jobs picked for promotion, % deleted', cardinality(ids), cardinality(promotions);
        END IF;
    END IF;
    FOR k IN
        SELECT g.key FROM unnest(keys) AS g(key)
         CROSS JOIN LATERAL (SELECT x.value FROM lockgate.semaphores x WHERE x.key = g.key OFFSET 0) s
         CROSS JOIN LATERAL (SELECT x.job_type FROM lockgate.parked x WHERE x.key = g.key
                              ORDER BY x.priority, x.id LIMIT 1) head
          LEFT JOIN LATERAL (SELECT jt.concurrency_limit FROM lockgate.job_types jt
                              WHERE jt.name = head.job_type OFFSET 0) jt ON true
         WHERE jt.concurrency_limit IS NULL OR s.value < jt.concurrency_limit
         ORDER BY g.key
    LOOP
        promotions := promotions || ARRAY(SELECT p FROM lockgate._promote(k) p);
    END LOOP;
    RETURN promotions;
END $$;

-- Decrements a key's value by the number of lease rows the caller just deleted.
CREATE OR REPLACE FUNCTION lockgate._give_back(key text, n integer)
RETURNS void LANGUAGE sql AS $$
    UPDATE lockgate.semaphores s SET value = s.value - n, updated_at = now() WHERE s.key = _give_back.key
$$;

-- Moves a parked job to the dead letters (its type no longer resolves, or its queue is gone),
-- releasing its uniqueness lock and counting it as failed in its batch.
CREATE OR REPLACE FUNCTION lockgate._dead_letter_parked(p lockgate.parked, why text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM lockgate.parked x WHERE x.id = p.id;
    INSERT INTO lockgate.dead_letters (queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, enqueued_at)
    VALUES (p.queue, NULL, p.job_id, p.job_type, p.args, p.headers, 'unknown_job_type', why, 0, p.parked_at);
    PERFORM lockgate._release_unique(p.queue, ARRAY[p.job_id], ARRAY[NULL::bigint]);
    IF p.headers ? 'batch' THEN
        PERFORM lockgate._count_batch_jobs(p.queue, ARRAY[p.job_id], true, NULL);
    END IF;
END $$;

-- Promotes parked jobs of key, best priority then oldest first, while a permit can be taken
-- through the guarded acquire: deletes each from the parked jobs and returns what to send
-- (lockgate._send_promotions sends them, one statement per queue, in the same transaction). A
-- promoted job becomes a new message, visible at its scheduled time (a promoted scheduled job
-- keeps its remaining delay, H9), holding a lease. A job of a queue whose table is gone is
-- dead-lettered; one whose table was made again behind lockgate's back stops the key's promotions
-- until lockgate adopts the table. A job whose type no longer resolves is never
-- promoted under a guessed limit: it is dead-lettered (H16). A type whose limit was removed runs
-- unlimited: its message carries no key, so the heartbeat does not look for a lease.
CREATE OR REPLACE FUNCTION lockgate._promote(key text)
RETURNS SETOF lockgate.promotion LANGUAGE plpgsql AS $$
DECLARE
    p lockgate.parked;
    jt lockgate.job_types;
BEGIN
    LOOP
        SELECT * INTO p FROM lockgate.parked x WHERE x.key = _promote.key
         ORDER BY x.priority, x.id LIMIT 1 FOR UPDATE SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        IF jt.name IS DISTINCT FROM p.job_type THEN
            SELECT * INTO jt FROM lockgate.job_types t WHERE t.name = p.job_type;
            IF NOT FOUND THEN
                PERFORM lockgate._dead_letter_parked(p, format('job type "%s" no longer exists; a parked job is never promoted under a guessed limit', p.job_type));
                CONTINUE;
            END IF;
        END IF;
        IF p.queue NOT IN (SELECT lockgate._live_queues()) THEN
            -- A table made again behind lockgate's back waits, parked, for lockgate to adopt it
            -- (the next migrate, or create_queue): its own ids would repeat other jobs'.
            EXIT WHEN lockgate._made_again(p.queue);
            PERFORM lockgate._dead_letter_parked(p, format('queue "%s" no longer exists', p.queue));
            CONTINUE;
        END IF;
        IF jt.concurrency_limit IS NOT NULL THEN
            EXIT WHEN NOT lockgate._acquire(key, jt.concurrency_limit, jt.name);
        END IF;
        DELETE FROM lockgate.parked x WHERE x.id = p.id;
        RETURN NEXT ROW(p.queue, GREATEST(p.run_at, clock_timestamp()), p.args,
                        CASE WHEN jt.concurrency_limit IS NULL THEN p.headers - 'ckey' - 'ckey_explicit' ELSE p.headers END,
                        CASE WHEN jt.concurrency_limit IS NULL THEN NULL ELSE key END,
                        jt.concurrency_duration_ms)::lockgate.promotion;
    END LOOP;
END $$;

-- The statement that sends the promotions of one queue whose table is tbl (lockgate._send_promotions'
-- parameters: $1 every promotion, $2 the queue; nothing returned). Message ids are drawn up
-- front (from the sequence every queue's msg_id defaults to), so the leases are written from the
-- same rows as the messages, without matching the inserted messages back to their promotions;
-- the uniqueness locks of jobs that hold one move to their new messages, and the batch
-- memberships of jobs in a batch name them (design §111). Each lock or membership is found by a
-- probe driven by its job (a lateral subquery no plan can turn into a walk of the table), locked
-- there, and updated by its row address: joined on the queue, a plan made while the locks had
-- been analysed empty read every lock of the queue at each promotion (docs/design.md §64), and
-- so did the memberships' (tests/plans.rs).
CREATE OR REPLACE FUNCTION lockgate._promote_sql(tbl text)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT format(
        'WITH src AS MATERIALIZED (
             SELECT nextval(''lockgate.job_id_seq'') AS msg_id, u.*
               FROM (SELECT * FROM unnest($1) WITH ORDINALITY AS u(queue, vt, args, headers, key, duration_ms, o)
                      WHERE u.queue = $2 ORDER BY u.o) u),
              sent AS (INSERT INTO %1$s (msg_id, vt, message, headers)
                       SELECT src.msg_id, src.vt, src.args, src.headers FROM src),
              moved AS (UPDATE lockgate.unique_locks u SET msg_id = h.msg_id, acquired_at = now()
                          FROM (SELECT src.msg_id, x.tid FROM src
                                 CROSS JOIN LATERAL (SELECT l.ctid AS tid FROM lockgate.unique_locks l
                                                      WHERE l.queue = src.queue
                                                        AND l.job_id = (src.headers->>''job_id'')::bigint
                                                     OFFSET 0 FOR UPDATE) x
                                 WHERE src.headers ? ''ukey'') h
                         WHERE u.ctid = h.tid),
              joined AS (UPDATE lockgate.batch_jobs b SET msg_id = h.msg_id
                           FROM (SELECT src.msg_id, x.tid FROM src
                                  CROSS JOIN LATERAL (SELECT m.ctid AS tid FROM lockgate.batch_jobs m
                                                       WHERE m.queue = src.queue
                                                         AND m.job_id = (src.headers->>''job_id'')::bigint
                                                      OFFSET 0 FOR UPDATE) x
                                  WHERE src.headers ? ''batch'') h
                          WHERE b.ctid = h.tid)
         INSERT INTO lockgate.leases (queue, msg_id, key, duration_ms, expires_at, job_type)
         SELECT $2, src.msg_id, src.key, src.duration_ms,
                GREATEST(src.vt, clock_timestamp())
                + lockgate._lease_interval(src.duration_ms, (SELECT lockgate._lease_floor_ms())),
                src.headers->>''type''
           FROM src WHERE src.key IS NOT NULL', tbl)
$$;

-- A queue's promotion step, generated with its table's name written in, as its enqueue and
-- completion steps are: lockgate._promote_into_<queue>(promotions, queue) runs
-- lockgate._promote_sql's statement, planned once per session, where _send_promotions would
-- plan it at every call (most of a promotion's cost when a completion promotes a few jobs).
-- Its plan is always the generic one, with sequential scans, hash and merge joins and JIT off:
-- the uniqueness locks are joined by their index however few there were when the plan was made.
-- Written through lockgate._write_step by create_queue and, for every queue, each time the
-- functions are installed (the end of this file); never inside a completion's transaction.
-- SECURITY DEFINER, with typed arguments in every call, for the reasons the other installers
-- are. Locks: none when nothing changes; else the queue name's advisory lock, then
-- catalog rows. Callers: create_queue, migrate.
CREATE OR REPLACE FUNCTION lockgate._install_promote_steps(queue text)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET client_min_messages = warning AS $$
BEGIN
    PERFORM lockgate._write_step(queue, '_promote_into_'::text,
        'void'::text,
        '{plan_cache_mode=force_generic_plan,enable_seqscan=off,enable_hashjoin=off,enable_mergejoin=off,jit=off}'::text[],
        format(E'\n        BEGIN\n            %s;\n        END ', lockgate._promote_sql(lockgate._queue_table(queue, 'q'::text))),
        '{}'::text[]);
END $$;

-- Sends promoted jobs: per queue, its messages, the leases of those with a key and the moves of
-- their uniqueness locks (lockgate._promote_sql), through the queue's promotion step when
-- lockgate._trusted_step trusts it, else planned at this call; and one notification per queue
-- with a job visible now. Returns how many it sent.
CREATE OR REPLACE FUNCTION lockgate._send_promotions(promotions lockgate.promotion[])
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    q record;
BEGIN
    IF cardinality(promotions) = 0 THEN
        RETURN 0;
    END IF;
    FOR q IN SELECT DISTINCT u.queue, bool_or(u.vt <= clock_timestamp()) OVER (PARTITION BY u.queue) AS now_visible
               FROM unnest(promotions) u LOOP
        IF lockgate._trusted_step('_promote_into_', q.queue) THEN
            EXECUTE format('SELECT lockgate.%I($1, $2)', '_promote_into_' || q.queue) USING promotions, q.queue;
        ELSE
            EXECUTE lockgate._promote_sql(lockgate._queue_table(q.queue, 'q')) USING promotions, q.queue;
        END IF;
        IF q.now_visible THEN
            PERFORM pg_notify('lockgate_' || q.queue, '');
        END IF;
    END LOOP;
    RETURN cardinality(promotions);
END $$;

-- Deletes the semaphore rows of idle keys: no permit held, nothing parked, unchanged for longer
-- than idle. A key's row is created at its first acquire and otherwise never deleted, so keys
-- per account or per tenant would grow the table without bound (issue 14); a reclaimed key that
-- is used again gets a new row at its next acquire. Safe under the rows' locks: they are taken
-- first (SKIP LOCKED: a key an enqueue, claim or completion holds is left for a later pass), and
-- every path that parks a job or adds a lease holds its key's row first, so the second
-- statement, with a snapshot taken after the locks, sees every park and lease that will ever
-- name these keys until they are deleted. At most max_rows keys per call; returns how many it
-- deleted. Locks: semaphore rows (SKIP LOCKED). Callers: the bookkeeping sweep, operators.
CREATE OR REPLACE FUNCTION lockgate.reclaim_idle_keys(idle interval DEFAULT '10 minutes', max_rows integer DEFAULT 10000)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    locked text[];
    n integer;
BEGIN
    locked := ARRAY(SELECT s.key FROM lockgate.semaphores s
                     WHERE s.value = 0 AND s.updated_at < now() - idle
                     ORDER BY s.key LIMIT max_rows
                       FOR UPDATE SKIP LOCKED);
    WITH gone AS (
        DELETE FROM lockgate.semaphores s USING unnest(locked) AS k(key)
         WHERE s.key = k.key AND s.value = 0
           AND NOT EXISTS (SELECT 1 FROM lockgate.parked p WHERE p.key = s.key)
           AND NOT EXISTS (SELECT 1 FROM lockgate.leases l WHERE l.key = s.key)
        RETURNING 1)
    SELECT count(*) INTO n FROM gone;
    RETURN n;
END $$;

-- Every queue's promotion step, written again with each install of these functions (not for a
-- queue whose table was dropped behind lockgate's back).
SELECT lockgate._install_promote_steps(q) FROM lockgate._live_queues() q;
