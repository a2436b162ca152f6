-- Heartbeat: renew the visibility of running deliveries and, for limited jobs, their leases
-- (G6), both fenced on the delivery's token (msg_id, read_ct) (H25): a stale delivery renews
-- nothing, neither the message nor a successor's lease. A limited job's message is renewed only
-- with its lease, and never past it (vt <= expires_at); a delivery whose lease is gone or past
-- its end is not renewed: it is lost, its handler is cancelled, and its next delivery takes a
-- permit again or parks. A message waiting out a retry backoff or returned by shutdown (marked
-- with retry_at) is not renewed: a heartbeat that raced its retry must not push it out. Nor is
-- a delivery holding a while_executing key whose visibility has run out: its key may have gone
-- to a duplicate since (lockgate._take_unique), which runs; the delivery is lost, as a limited
-- one past its lease is. Leases are floored at twice the heartbeat interval (H10).
--
-- Never waits for a row lock (H28): a message or lease another statement holds (the delivery's
-- own completion, retry or return, a sweep expiring the lease) is skipped and reported busy.
-- Returns one row per delivery asked about that is still owned: budget_seconds is how long its
-- visibility now holds, counted from the start of the call, or NULL when it was busy. A delivery
-- missing from the result is lost. owner, when given, re-tags the messages with the caller's
-- registry id (a process registered again after a prune keeps its running jobs, H26).
-- last_read_at is left alone: it records when the delivery started (H32, sql/020_claim.sql).
-- Locks: the message rows, then their lease rows, both SKIP LOCKED. Callers: the heartbeat, per
-- queue per tick.
CREATE OR REPLACE FUNCTION lockgate.extend(queue text, msg_ids bigint[], read_cts integer[], vt_seconds double precision,
                                           owner bigint DEFAULT NULL)
RETURNS TABLE (msg_id bigint, budget_seconds double precision) LANGUAGE plpgsql AS $$
DECLARE
    tbl text := lockgate._queue_table(queue, 'q');
    at timestamptz := clock_timestamp();
    owned bigint[];
    limited bigint[];
BEGIN
    IF vt_seconds IS NULL OR NOT vt_seconds > 0 OR vt_seconds IN ('infinity', 'NaN') THEN
        RAISE EXCEPTION 'lockgate: invalid visibility timeout % seconds: a positive, finite number', vt_seconds
            USING ERRCODE = 'LG003';
    END IF;
    -- The deliveries still owned and not waiting, locked in msg_id order.
    EXECUTE format(
        'SELECT array_agg(x.msg_id), array_agg(x.msg_id) FILTER (WHERE x.limited)
           FROM (SELECT m.msg_id, m.headers ? ''ckey'' AS limited
                   FROM %s m JOIN unnest($1::bigint[], $2::integer[]) AS d(msg_id, read_ct)
                     ON m.msg_id = d.msg_id AND m.read_ct = d.read_ct
                  WHERE NOT m.headers ? ''retry_at''
                    AND NOT (m.headers ? ''wkey'' AND m.vt <= clock_timestamp())
                  ORDER BY m.msg_id
                    FOR UPDATE OF m SKIP LOCKED) x',
        tbl)
       INTO owned, limited
      USING msg_ids, read_cts;
    RETURN QUERY EXECUTE format(
        'WITH leased AS (
             UPDATE lockgate.leases l
                SET expires_at = GREATEST(l.expires_at, clock_timestamp()
                                 + lockgate._lease_interval(l.duration_ms, (SELECT lockgate._lease_floor_ms())))
               FROM (SELECT x.queue, x.msg_id FROM lockgate.leases x JOIN unnest($4::bigint[]) AS k(msg_id)
                        ON x.queue = $3 AND x.msg_id = k.msg_id
                     WHERE x.expires_at > clock_timestamp()
                     ORDER BY x.msg_id
                       FOR UPDATE OF x SKIP LOCKED) live
              WHERE l.queue = live.queue AND l.msg_id = live.msg_id
             RETURNING l.msg_id, l.expires_at),
         renewed AS (
             UPDATE %1$s m
                SET vt = LEAST(clock_timestamp() + make_interval(secs => $2), leased.expires_at),
                    headers = CASE WHEN $5::bigint IS NULL OR m.headers->>''owner'' = $5::text THEN m.headers
                                   ELSE m.headers || jsonb_build_object(''owner'', $5::bigint) END
               FROM unnest($1::bigint[]) AS o(msg_id) LEFT JOIN leased ON leased.msg_id = o.msg_id
              WHERE m.msg_id = o.msg_id
                AND (NOT o.msg_id = ANY ($4::bigint[]) OR leased.msg_id IS NOT NULL)
                -- Again under the row lock: the scan above looked before it, and a claim may
                -- have judged the delivery lapsed in between (review helper-117 F3).
                AND NOT (m.headers ? ''wkey'' AND m.vt <= clock_timestamp())
             RETURNING m.msg_id, m.vt),
         -- Asked about, matching the fence, but held by another statement: ask again next tick.
         busy AS (
             SELECT d.msg_id FROM unnest($6::bigint[], $7::integer[]) AS d(msg_id, read_ct)
              WHERE NOT d.msg_id = ANY (COALESCE($1, ''{}''))
                AND EXISTS (SELECT 1 FROM %1$s m WHERE m.msg_id = d.msg_id AND m.read_ct = d.read_ct
                                                   AND NOT m.headers ? ''retry_at''
                                                   AND NOT (m.headers ? ''wkey'' AND m.vt <= clock_timestamp()))
             UNION ALL
             SELECT k.msg_id FROM unnest($4::bigint[]) AS k(msg_id)
              WHERE NOT EXISTS (SELECT 1 FROM leased WHERE leased.msg_id = k.msg_id)
                AND EXISTS (SELECT 1 FROM lockgate.leases x
                             WHERE x.queue = $3 AND x.msg_id = k.msg_id AND x.expires_at > clock_timestamp()))
         SELECT renewed.msg_id, extract(epoch FROM renewed.vt - $8)::double precision FROM renewed
         UNION ALL
         SELECT busy.msg_id, NULL FROM busy',
        tbl)
      USING owned, vt_seconds, queue, COALESCE(limited, '{}'), owner, msg_ids, read_cts, at;
END $$;
