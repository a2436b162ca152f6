-- Heartbeat: extend the visibility of running deliveries and, in the same statement, the leases
-- of their permits (G6). Fenced on (msg_id, read_ct). A limited job's message is extended only
-- if its lease was: the lease row is renewed first (locking it, so the sweep cannot expire it
-- meanwhile); a delivery whose lease is gone is not renewed, its handler is cancelled, and its
-- next delivery takes a permit again or parks. Leases are floored at twice the heartbeat
-- interval on renewal too (H10).
-- Returns the msg_ids still owned; a delivery missing from the result has lost its lease.
-- Locks: the lease rows, then the message rows. Callers: the heartbeat, per queue per tick.
CREATE OR REPLACE FUNCTION lockgate.extend(queue text, msg_ids bigint[], read_cts integer[], vt_seconds double precision)
RETURNS SETOF bigint LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY EXECUTE format(
        'WITH leased AS (
             UPDATE lockgate.leases l
                SET expires_at = clock_timestamp() + lockgate._lease_interval(l.duration_ms, (SELECT lockgate._lease_floor_ms()))
               FROM unnest($1::bigint[]) AS d(msg_id)
              WHERE l.queue = $4 AND l.msg_id = d.msg_id
             RETURNING l.msg_id)
         UPDATE %s m SET vt = clock_timestamp() + make_interval(secs => $3)
           FROM unnest($1::bigint[], $2::integer[]) AS d(msg_id, read_ct)
          WHERE m.msg_id = d.msg_id AND m.read_ct = d.read_ct
            AND (NOT (m.headers ? ''ckey'') OR m.msg_id IN (SELECT leased.msg_id FROM leased))
         RETURNING m.msg_id',
        lockgate._queue_table(queue, 'q'))
      USING msg_ids, read_cts, vt_seconds, queue;
END $$;
