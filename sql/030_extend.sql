-- Heartbeat: extend the visibility of running deliveries, fenced on (msg_id, read_ct). Returns
-- the msg_ids still owned; a delivery missing from the result has lost its lease (completed
-- elsewhere, or redelivered after its visibility lapsed) and its handler must be cancelled.
-- Locks: the rows it updates. Callers: the heartbeat task, once per queue per tick.
CREATE OR REPLACE FUNCTION lockgate.extend(queue text, msg_ids bigint[], read_cts integer[], vt_seconds double precision)
RETURNS SETOF bigint LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY EXECUTE format(
        'UPDATE %s m SET vt = clock_timestamp() + make_interval(secs => $3)
           FROM unnest($1::bigint[], $2::integer[]) AS d(msg_id, read_ct)
          WHERE m.msg_id = d.msg_id AND m.read_ct = d.read_ct
         RETURNING m.msg_id',
        lockgate._queue_table(queue, 'q'))
      USING msg_ids, read_cts, vt_seconds;
END $$;
