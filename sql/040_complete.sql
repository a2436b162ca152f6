-- Completion: the fenced archive of finished deliveries. A delivery is archived only where its
-- (msg_id, read_ct) still matches, so a stale delivery can never archive a message that a newer
-- delivery owns (PGMQ's own archive matches msg_id alone). Returns the msg_ids this call
-- archived; the caller reports every other one as AlreadyArchived (or Ambiguous on a retry after
-- a broken commit). This transaction is where permit release, promotion, batch counts and
-- uniqueness release hang, all gated by the rows it archived.
-- Locks: the deleted rows. Callers: the completer, batching many deliveries of one queue.
CREATE OR REPLACE FUNCTION lockgate.complete(queue text, msg_ids bigint[], read_cts integer[])
RETURNS SETOF bigint LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY EXECUTE format(
        'WITH done AS (
             DELETE FROM %1$s m
              USING unnest($1::bigint[], $2::integer[]) AS d(msg_id, read_ct)
              WHERE m.msg_id = d.msg_id AND m.read_ct = d.read_ct
             RETURNING m.*)
         INSERT INTO %2$s (msg_id, vt, read_ct, enqueued_at, last_read_at, message, headers)
         SELECT msg_id, vt, read_ct, enqueued_at, last_read_at, message, headers FROM done
         RETURNING msg_id',
        lockgate._queue_table(queue, 'q'), lockgate._queue_table(queue, 'a'))
      USING msg_ids, read_cts;
END $$;
