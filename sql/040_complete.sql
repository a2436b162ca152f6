-- Completion: the fenced archive of finished deliveries (lockgate.complete, below), through
-- each queue's generated completion step.

-- The statements of a completion on queue table tbl and its archive atbl, with ($1 msg_ids,
-- $2 read_cts, $3 started_ids, $4 started_cts): the start records of the deliveries claimed
-- ahead that have started (one), and the fenced archive, returning (archived msg_ids, those
-- with a concurrency key, [msg_id, headers] of those with a unique key or a batch) (not one).
-- The body of the queue's completion step, and the statements a completion plans itself when
-- it cannot trust the step.
CREATE OR REPLACE FUNCTION lockgate._complete_sql(tbl text, atbl text, starts boolean)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN starts THEN format(
        'UPDATE %1$s m SET last_read_at = clock_timestamp()
           FROM (SELECT x.msg_id FROM %1$s x JOIN unnest($3::bigint[], $4::integer[]) AS s(msg_id, read_ct)
                     ON x.msg_id = s.msg_id AND x.read_ct = s.read_ct
                  WHERE x.last_read_at IS NULL
                  ORDER BY x.msg_id FOR UPDATE OF x) started
          WHERE m.msg_id = started.msg_id', tbl)
    ELSE format(
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
           FROM ins', tbl, atbl) END
$$;

-- A queue's completion step, generated with its tables' names written in, as its claim and
-- enqueue steps are (sql/020_claim.sql, sql/010_enqueue.sql; docs/design.md §58):
-- lockgate._complete_into_<queue>(msg_ids, read_cts, started_ids, started_cts) records the starts
-- and archives, as lockgate._complete_sql's statements, planned once per session instead of at
-- every completion; one row (archived, limited, kept), none when msg_ids is empty. The plan is
-- the generic one, always (left to choose, PL/pgSQL planned a batch of a few jobs again at every
-- call, its custom plan looking cheaper), with sequential scans and hash and merge joins off: a
-- generic plan made while the queue was small and freshly analysed joined the ids to a
-- sequential scan of the table, and kept doing so once the queue held 200,000 jobs (50-90 ms a
-- completion of one job, review). Index lookups by msg_id are what a completion needs at any
-- size. Written through lockgate._write_step by create_queue and, for every
-- queue, each time the functions are installed (the end of this file). SECURITY DEFINER, with
-- typed arguments in every call, for the reasons the other installers are. Locks: none when
-- nothing changes; else the queue name's advisory lock, then catalog rows. Callers:
-- create_queue, migrate.
CREATE OR REPLACE FUNCTION lockgate._install_complete_steps(queue text)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET client_min_messages = warning AS $$
DECLARE
    tbl text := lockgate._queue_table(queue, 'q'::text);
    atbl text := lockgate._queue_table(queue, 'a'::text);
BEGIN
    PERFORM lockgate._write_step(queue, '_complete_into_'::text,
        'TABLE (archived bigint[], limited bigint[], kept jsonb)'::text,
        '{plan_cache_mode=force_generic_plan,enable_seqscan=off,enable_hashjoin=off,enable_mergejoin=off,jit=off}'::text[],
        format(E'\n        BEGIN\n            IF cardinality($3) > 0 THEN\n                %s;\n            END IF;\n'
               || E'            IF cardinality($1) > 0 THEN\n                RETURN QUERY %s;\n            END IF;\n        END ',
               lockgate._complete_sql(tbl, atbl, true), lockgate._complete_sql(tbl, atbl, false)),
        '{}'::text[]);
END $$;

-- Completes deliveries: the fenced archive of finished ones. A delivery is archived only where its
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
-- Never waits for a key's semaphore row another transaction holds (lockgate._release_leases): a
-- permit whose row an open producer transaction holds goes back at the sweep after it commits.
-- Locks: the started message rows in msg_id order (as a release locks its rows), the deleted
-- message rows, their lease rows, then semaphore rows in key order (each only if free), then
-- unique lock rows, then batch membership rows, batch rows in id order. Callers: the completer,
-- batching many deliveries of one queue.
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
    batched_msgs bigint[];
BEGIN
    IF lockgate._trusted_step('_complete_into_', queue) THEN
        EXECUTE format('SELECT * FROM lockgate.%I($1, $2, $3, $4)', '_complete_into_' || queue)
           INTO archived, limited, kept
          USING msg_ids, read_cts, started_ids, started_cts;
    ELSE
        IF cardinality(started_ids) > 0 THEN
            EXECUTE lockgate._complete_sql(lockgate._queue_table(queue, 'q'), NULL, true)
              USING msg_ids, read_cts, started_ids, started_cts;
        END IF;
        IF cardinality(msg_ids) > 0 THEN
            EXECUTE lockgate._complete_sql(lockgate._queue_table(queue, 'q'), lockgate._queue_table(queue, 'a'), false)
               INTO archived, limited, kept
              USING msg_ids, read_cts, started_ids, started_cts;
        END IF;
    END IF;
    IF archived IS NULL THEN
        RETURN;
    END IF;
    IF limited IS NOT NULL THEN
        PERFORM lockgate._release_leases(queue, limited);
    END IF;
    IF kept IS NOT NULL THEN
        SELECT array_agg(COALESCE(lockgate._job_id_of(k.h), k.id)) FILTER (WHERE k.h ? 'ukey' OR k.h ? 'wkey'),
               array_agg(k.id) FILTER (WHERE k.h ? 'ukey' OR k.h ? 'wkey'),
               array_agg(COALESCE(lockgate._job_id_of(k.h), k.id)) FILTER (WHERE k.h ? 'batch'),
               array_agg(k.id) FILTER (WHERE k.h ? 'batch')
          INTO uniq, uniq_msgs, batched, batched_msgs
          FROM (SELECT (e->>0)::bigint AS id, e->1 AS h FROM jsonb_array_elements(kept) e) k;
    END IF;
    IF uniq IS NOT NULL THEN
        PERFORM lockgate._release_unique(queue, uniq, uniq_msgs);
    END IF;
    IF batched IS NOT NULL THEN
        PERFORM lockgate._count_batch_jobs(queue, batched, false, batched_msgs);
    END IF;
    RETURN QUERY SELECT unnest(archived);
END $$;

-- Every queue's completion step, written again with each install of these functions (not for a
-- queue whose table was dropped behind lockgate's back).
SELECT lockgate._install_complete_steps(q) FROM lockgate._live_queues() q;
