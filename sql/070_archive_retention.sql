-- Archive retention: delete up to max_rows archived messages of a queue older than
-- retention_seconds. Bounded per call so a large backlog is pruned over several ticks without a
-- long-running transaction. Returns how many rows it deleted: none for a queue whose table was
-- dropped (or made again) behind lockgate's back, which check_invariants reports, so that a
-- sweep over every queue goes on to the others instead of failing at that one.
-- Locks: the deleted archive rows. Callers: the maintenance service's archive-retention sweep.
CREATE OR REPLACE FUNCTION lockgate.prune_archive(queue text, retention_seconds double precision, max_rows integer)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    tbl text := lockgate._queue_table(queue, 'a');
    deleted bigint;
BEGIN
    IF queue NOT IN (SELECT lockgate._live_queues()) THEN
        RETURN 0;
    END IF;
    EXECUTE format(
        'WITH old AS (SELECT msg_id FROM %1$s WHERE archived_at < now() - make_interval(secs => $1)
                       ORDER BY archived_at LIMIT $2 FOR UPDATE SKIP LOCKED),
              gone AS (DELETE FROM %1$s a USING old WHERE a.msg_id = old.msg_id RETURNING 1)
         SELECT count(*) FROM gone',
        tbl)
       INTO deleted
      USING retention_seconds, max_rows;
    RETURN deleted;
END $$;
