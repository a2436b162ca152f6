-- Completion: the fenced archive of finished deliveries. A delivery is archived only where its
-- (msg_id, read_ct) still matches, so a stale delivery can never archive a message that a newer
-- delivery owns (PGMQ's own archive matches msg_id alone). In the same transaction, and only for
-- the rows this statement archived, the jobs' leases are deleted, their permits given back and
-- the next parked jobs promoted (G2, H1, H6, H7), their uniqueness locks released (H14) and
-- their batches counted, finishing a batch whose last job this is (H22). Returns the msg_ids
-- this call archived; the caller reports every other one as AlreadyArchived (or Ambiguous on a
-- retry after a broken commit).
--
-- started_ids/started_cts: deliveries claimed ahead that have started since (H32): their start
-- is recorded (last_read_at, NULL until then), fenced on (msg_id, read_ct), so their run counts
-- as an attempt even if their worker dies. Riding on the completions' statement, a start costs
-- no commit of its own while jobs finish, and a HOT update (last_read_at is in no index).
-- Locks: the started message rows in msg_id order (as a release locks its rows), the deleted
-- message rows, their lease rows, then semaphore rows in key order, then unique lock rows, then
-- batch membership rows, batch rows in id order. Callers: the completer, batching many
-- deliveries of one queue.
CREATE OR REPLACE FUNCTION lockgate.complete(queue text, msg_ids bigint[], read_cts integer[],
                                             started_ids bigint[] DEFAULT NULL, started_cts integer[] DEFAULT NULL)
RETURNS SETOF bigint LANGUAGE plpgsql AS $$
DECLARE
    archived bigint[];
    limited bigint[];
    -- [msg_id, headers] of the archived jobs with a unique key or a batch (rare: one check per
    -- row on the hot path, the rest only for them).
    kept jsonb;
    uniq bigint[];
    uniq_msgs bigint[];
    batched bigint[];
BEGIN
    IF cardinality(started_ids) > 0 THEN
        EXECUTE format(
            'UPDATE %1$s m SET last_read_at = clock_timestamp()
               FROM (SELECT x.msg_id FROM %1$s x JOIN unnest($1::bigint[], $2::integer[]) AS s(msg_id, read_ct)
                         ON x.msg_id = s.msg_id AND x.read_ct = s.read_ct
                      WHERE x.last_read_at IS NULL
                      ORDER BY x.msg_id FOR UPDATE OF x) started
              WHERE m.msg_id = started.msg_id',
            lockgate._queue_table(queue, 'q'))
          USING started_ids, started_cts;
    END IF;
    IF cardinality(msg_ids) = 0 THEN
        RETURN;
    END IF;
    EXECUTE format(
        'WITH done AS (
             DELETE FROM %1$s m
              USING unnest($1::bigint[], $2::integer[]) AS d(msg_id, read_ct)
              WHERE m.msg_id = d.msg_id AND m.read_ct = d.read_ct
             RETURNING m.*),
         ins AS (
             INSERT INTO %2$s (msg_id, vt, read_ct, enqueued_at, last_read_at, message, headers)
             SELECT msg_id, vt, read_ct, enqueued_at, last_read_at, message, headers FROM done
             RETURNING msg_id, headers)
         SELECT array_agg(msg_id), array_agg(msg_id) FILTER (WHERE headers ? ''ckey''),
                jsonb_agg(jsonb_build_array(msg_id, headers)) FILTER (WHERE headers ?| ''{ukey,wkey,batch}'')
           FROM ins',
        lockgate._queue_table(queue, 'q'), lockgate._queue_table(queue, 'a'))
       INTO archived, limited, kept
      USING msg_ids, read_cts;
    IF limited IS NOT NULL THEN
        PERFORM lockgate._release_leases(queue, limited);
    END IF;
    IF kept IS NOT NULL THEN
        SELECT array_agg(COALESCE(lockgate._job_id_of(k.h), k.id)) FILTER (WHERE k.h ? 'ukey' OR k.h ? 'wkey'),
               array_agg(k.id) FILTER (WHERE k.h ? 'ukey' OR k.h ? 'wkey'),
               array_agg(COALESCE(lockgate._job_id_of(k.h), k.id)) FILTER (WHERE k.h ? 'batch')
          INTO uniq, uniq_msgs, batched
          FROM (SELECT (e->>0)::bigint AS id, e->1 AS h FROM jsonb_array_elements(kept) e) k;
    END IF;
    IF uniq IS NOT NULL THEN
        PERFORM lockgate._release_unique(queue, uniq, uniq_msgs);
    END IF;
    IF batched IS NOT NULL THEN
        PERFORM lockgate._count_batch_jobs(queue, batched, false);
    END IF;
    RETURN QUERY SELECT unnest(archived);
END $$;
