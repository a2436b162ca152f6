-- Concurrency keys for operators: per-key counts, a key's parked jobs, and the explicit discard
-- of a parked job (the only way besides promotion that a parked job leaves, G4).
-- Locks: none for the reads; discard deletes the parked row.
-- Callers: lockgate status, lockgate parked list|discard, SQL operators.

CREATE OR REPLACE FUNCTION lockgate.key_stats()
RETURNS TABLE (key text, lim integer, held integer, parked bigint, oldest_parked_seconds double precision)
LANGUAGE sql STABLE AS $$
    SELECT k.key, s.lim, COALESCE(s.value, 0), COALESCE(p.n, 0),
           extract(epoch FROM now() - p.oldest)::double precision
      FROM (SELECT x.key FROM lockgate.semaphores x UNION SELECT y.key FROM lockgate.parked y) k
      LEFT JOIN lockgate.semaphores s ON s.key = k.key
      LEFT JOIN (SELECT z.key, count(*) AS n, min(z.parked_at) AS oldest FROM lockgate.parked z GROUP BY z.key) p
             ON p.key = k.key
     WHERE COALESCE(s.value, 0) > 0 OR COALESCE(p.n, 0) > 0
     ORDER BY k.key
$$;

CREATE OR REPLACE FUNCTION lockgate.parked_jobs(only_key text DEFAULT NULL, max_rows integer DEFAULT 100)
RETURNS SETOF lockgate.parked LANGUAGE sql STABLE AS $$
    SELECT * FROM lockgate.parked p WHERE only_key IS NULL OR p.key = only_key
     ORDER BY p.key, p.priority, p.id LIMIT max_rows
$$;

-- After a parked job left its key other than by promotion (an operator's discard, a cancel): the
-- jobs behind it that the key has room for are promoted now, as a completion promotes them, not
-- at the next sweep. It may have been the key's head, holding back jobs of a looser type behind
-- it on a key types share (design §113; found by the model). Only when the key's row is free
-- (SKIP LOCKED: never waits, so the call, which has deleted the parked row and may hold its
-- unique lock and batch row, closes no cycle; the row is then held until commit, review
-- helper-133 F1) and in READ COMMITTED (an older
-- snapshot does not see every job parked behind the key, lockgate._release_leases); else the
-- sweep promotes them within sweep_interval (G5).
CREATE OR REPLACE FUNCTION lockgate._promote_behind(key text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN;
    END IF;
    PERFORM 1 FROM lockgate.semaphores s WHERE s.key = _promote_behind.key FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        PERFORM lockgate._send_promotions(lockgate._promote_keys(ARRAY[key], ARRAY[0]));
    END IF;
END $$;

-- Deletes one parked job for good, releasing its uniqueness lock and counting it as failed in
-- its batch, and promotes the jobs behind it that its key has room for; returns whether it
-- existed.
CREATE OR REPLACE FUNCTION lockgate.discard_parked(parked_id bigint)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    p lockgate.parked;
BEGIN
    DELETE FROM lockgate.parked x WHERE x.id = parked_id RETURNING x.* INTO p;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM lockgate._release_unique(p.queue, ARRAY[p.job_id], ARRAY[NULL::bigint]);
    IF p.headers ? 'batch' THEN
        PERFORM lockgate._count_batch_jobs(p.queue, ARRAY[p.job_id], true, NULL);
    END IF;
    PERFORM lockgate._promote_behind(p.key);
    RETURN true;
END $$;

-- The concurrency invariants, as rows of violations (none when all hold). Over permits: for
-- every key, value = number of live leases <= limit, and a type recorded as its holders' alone is
-- theirs; no expired lease points at a message that
-- no longer exists (run it after a sweep, which frees such leases once they expire; before then
-- the message's holder may still be running), except the lease of a job that finished while
-- another transaction held its key's row (finished_at), which the sweep frees once it can. Over deliveries (G3, H24): every
-- limited job in flight (claimed, not waiting, still invisible) holds a lease of its own key that
-- lasts at least as long as its visibility (so its holder's budget ends before its permit), and
-- no key has more such deliveries than its limit. Every concurrency test ends with it.
CREATE OR REPLACE FUNCTION lockgate.check_invariants()
RETURNS TABLE (key text, problem text) LANGUAGE plpgsql STABLE AS $$
DECLARE
    q record;
BEGIN
    RETURN QUERY
        SELECT s.key, format('value %s but %s live leases', s.value, count(l.msg_id))
          FROM lockgate.semaphores s LEFT JOIN lockgate.leases l ON l.key = s.key
         GROUP BY s.key, s.value HAVING s.value <> count(l.msg_id);
    RETURN QUERY
        SELECT s.key, format('value %s above limit %s', s.value, s.lim) FROM lockgate.semaphores s WHERE s.value > s.lim;
    -- A key recorded as held by jobs of one type alone admits that type's jobs under its own
    -- limit without looking at the holders (lockgate._acquire): no holder may be of another.
    RETURN QUERY
        SELECT s.key, format('recorded as held by type %s alone, but %s leases are of %s', s.sole_type, count(*),
                             string_agg(DISTINCT COALESCE(l.job_type, 'no recorded type'), ', '))
          FROM lockgate.semaphores s JOIN lockgate.leases l ON l.key = s.key
         WHERE s.sole_type IS NOT NULL AND l.job_type IS DISTINCT FROM s.sole_type
         GROUP BY s.key, s.sole_type;
    -- No foreign key stands behind this since migration 18: every path adding a lease holds its
    -- key's row locked.
    RETURN QUERY
        SELECT l.key, format('%s leases but no semaphore row', count(*))
          FROM lockgate.leases l
         WHERE NOT EXISTS (SELECT 1 FROM lockgate.semaphores s WHERE s.key = l.key)
         GROUP BY l.key;
    RETURN QUERY
        SELECT NULL::text,
               CASE WHEN lockgate._made_again(q2.name)
                    THEN format('queue %s has a PGMQ table made again outside lockgate (pgmq.create), numbering its '
                                'messages from 1: run lockgate migrate to adopt it', q2.name)
                    ELSE format('queue %s has no PGMQ table (dropped outside lockgate)', q2.name) END
          FROM lockgate.queues q2 WHERE q2.name NOT IN (SELECT lockgate._live_queues());
    FOR q IN SELECT lockgate._live_queues() AS name LOOP
        RETURN QUERY EXECUTE format(
            'SELECT l.key, format(''expired lease on missing message %%s/%%s'', l.queue, l.msg_id)
               FROM lockgate.leases l WHERE l.queue = $1 AND l.expires_at < now() AND l.finished_at IS NULL
                AND NOT EXISTS (SELECT 1 FROM %s m WHERE m.msg_id = l.msg_id)',
            lockgate._queue_table(q.name, 'q'))
          USING q.name;
        RETURN QUERY EXECUTE format(
            'WITH in_flight AS (
                 SELECT m.msg_id, m.vt, m.headers->>''ckey'' AS key, l.key AS lease_key, l.expires_at
                   FROM %s m
                   LEFT JOIN lockgate.leases l ON l.queue = $1 AND l.msg_id = m.msg_id
                  WHERE jsonb_typeof(m.headers) = ''object'' AND m.headers ? ''ckey''
                    AND m.read_ct > 0 AND m.vt > now() AND NOT m.headers ? ''retry_at'')
             SELECT f.key, CASE
                        WHEN f.lease_key IS NULL THEN format(''delivery %%s/%%s in flight without a lease'', $1, f.msg_id)
                        WHEN f.lease_key <> f.key THEN format(''delivery %%s/%%s holds a lease of key %%s'', $1, f.msg_id, f.lease_key)
                        ELSE format(''delivery %%s/%%s visible at %%s outlives its lease (ends %%s)'', $1, f.msg_id, f.vt, f.expires_at)
                    END
               FROM in_flight f
              WHERE f.lease_key IS NULL OR f.lease_key <> f.key OR f.expires_at < f.vt
             UNION ALL
             SELECT f.key, format(''%%s deliveries in flight holding leases, limit %%s'', count(*), s.lim)
               FROM in_flight f JOIN lockgate.semaphores s ON s.key = f.key
              WHERE f.lease_key = f.key AND f.expires_at >= f.vt
              GROUP BY f.key, s.lim HAVING count(*) > s.lim',
            lockgate._queue_table(q.name, 'q'))
          USING q.name;
    END LOOP;
    RETURN QUERY
        SELECT l.key, format('lease on %s/%s of unknown queue', l.queue, l.msg_id)
          FROM lockgate.leases l WHERE NOT EXISTS (SELECT 1 FROM lockgate.queues q2 WHERE q2.name = l.queue);
END $$;
