-- Dead-letter operations. Filters: only_queue (NULL = every queue) and job_ids (NULL = every job).
-- dlq_retry sends each matching dead letter back to its queue as a new message with the same
-- job id and attempt history (its attempt count starts again), then removes the dead letter,
-- in one transaction: status 'enqueued'. A job of an until_executed type takes its unique key
-- again (its own job never counts as a duplicate of itself); when another job holds the key
-- now, the dead letter stays where it is: status 'duplicate', job_id naming the holder; one whose
-- queue (or its PGMQ table) no longer exists stays too: status 'queue_missing'; and one whose job
-- type is not defined (removed since, or never: reason unknown_job_type): status 'type_missing'. A job
-- that was counted as failed in a batch runs outside it (the batch's count is final).
-- A dead letter another transaction holds (a retry or purge under way) is passed over, never
-- waited for: two operators never retry the same row twice. With report_busy it is returned as
-- 'busy' (msg_id NULL), and so is one whose unique key a transaction not yet committed is
-- taking or giving up (a producer's enqueue of the same key), which is waited for at most 1 s
-- instead of for as long as that transaction stays open: either stays dead, for the caller to
-- try again. Without it (the two-argument form, as before revision 49) busy rows are left out
-- of the result, and a key is waited for. dlq_purge deletes them for good (an operator's
-- explicit discard).
-- Locks: the dead_letters rows (SKIP LOCKED, one at a time), unique lock rows. Callers: lockgate
-- dlq retry|purge, lockgate job retry, the dashboard, SQL operators.
-- The headers' mark of where a new life of the job's attempt history starts: after every entry
-- of its errors so far (none when they are not a list).
CREATE OR REPLACE FUNCTION lockgate._history_mark(headers jsonb)
RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object('history_from', CASE WHEN jsonb_typeof(headers->'errors') = 'array'
                                                   THEN jsonb_array_length(headers->'errors') ELSE 0 END)
$$;

CREATE OR REPLACE FUNCTION lockgate.dlq_retry(only_queue text, job_ids bigint[], report_busy boolean)
RETURNS TABLE (queue text, msg_id bigint, job_id bigint, status text) LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    seen record;
    dl lockgate.dead_letters;
    new_msg_id bigint;
    holder bigint;
    saved text := current_setting('lock_timeout');
BEGIN
    FOR seen IN
        SELECT x.id, x.queue, x.job_id FROM lockgate.dead_letters x
         WHERE (dlq_retry.only_queue IS NULL OR x.queue = dlq_retry.only_queue)
           AND (dlq_retry.job_ids IS NULL OR x.job_id = ANY (dlq_retry.job_ids)
                -- A message sent without lockgate's headers has no job id; lockgate.job()
                -- shows it under its msg_id, and so it is found (review helper-81).
                OR (x.job_id IS NULL AND x.msg_id = ANY (dlq_retry.job_ids)))
         ORDER BY x.id
    LOOP
        SELECT * INTO dl FROM lockgate.dead_letters x WHERE x.id = seen.id FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            -- Held by another transaction, or gone since (retried or purged by one that committed).
            IF report_busy AND EXISTS (SELECT 1 FROM lockgate.dead_letters x WHERE x.id = seen.id) THEN
                queue := seen.queue;
                msg_id := NULL;
                job_id := seen.job_id;
                status := 'busy';
                RETURN NEXT;
            END IF;
            CONTINUE;
        END IF;
        queue := dl.queue;
        IF dl.queue NOT IN (SELECT lockgate._live_queues()) THEN
            -- Its queue (or the queue's PGMQ table) is gone: it stays, and the others go on.
            msg_id := NULL;
            job_id := dl.job_id;
            status := 'queue_missing';
            RETURN NEXT;
            CONTINUE;
        END IF;
        -- Its type's row, FOR KEY SHARE until the commit: lockgate.remove_job_type takes it FOR
        -- UPDATE before it counts the type's jobs and dead letters, so it either waits for this
        -- retry and counts its job, or counts the dead letter before this moves it; without the
        -- lock a retry committed between its two counts was counted in neither (design §91).
        -- A type no longer defined (removed, or never defined: a dead letter of reason
        -- unknown_job_type) keeps its dead letter: sent back, it would be dead-lettered again at
        -- its first claim while the retry said it was retried (review helper-121 F5).
        IF dl.job_type IS NOT NULL THEN
            PERFORM 1 FROM lockgate.job_types t WHERE t.name = dl.job_type FOR KEY SHARE;
            IF NOT FOUND THEN
                msg_id := NULL;
                job_id := dl.job_id;
                status := 'type_missing';
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;
        new_msg_id := nextval('lockgate.job_id_seq');
        -- Only a well-formed key of a known type is taken: anything else is resent without it (a
        -- malformed message is dead-lettered again by its next claim, with its reason).
        IF jsonb_typeof(dl.headers) = 'object' AND jsonb_typeof(dl.headers->'ukey') = 'string'
           AND length(dl.headers->>'ukey') BETWEEN 1 AND 512 AND dl.job_type IS NOT NULL THEN
            IF report_busy THEN
                BEGIN
                    PERFORM set_config('lock_timeout', '1s', true);
                    holder := lockgate._take_unique(dl.headers->>'ukey', 'until_executed', dl.job_type, dl.queue,
                                                    COALESCE(dl.job_id, new_msg_id), new_msg_id);
                    PERFORM set_config('lock_timeout', saved, true);
                EXCEPTION WHEN lock_not_available THEN
                    PERFORM set_config('lock_timeout', saved, true);
                    msg_id := NULL;
                    job_id := dl.job_id;
                    status := 'busy';
                    RETURN NEXT;
                    CONTINUE;
                END;
            ELSE
                holder := lockgate._take_unique(dl.headers->>'ukey', 'until_executed', dl.job_type, dl.queue,
                                                COALESCE(dl.job_id, new_msg_id), new_msg_id);
            END IF;
            IF holder IS NOT NULL THEN
                msg_id := NULL;
                job_id := holder;
                status := 'duplicate';
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;
        EXECUTE format('INSERT INTO %s (msg_id, vt, message, headers) VALUES ($3, clock_timestamp(), $1, $2)',
                       lockgate._queue_table(dl.queue, 'q'))
          USING dl.args,
                CASE WHEN jsonb_typeof(dl.headers) <> 'object' THEN dl.headers
                     -- A new message with a fresh set of attempts, numbered from 1 again: its
                     -- history so far is an earlier life's (history_from marks where it ends).
                     WHEN dl.job_id IS NULL THEN dl.headers - 'returns' - 'retry_at' - 'attempts_before' - 'unstarted' - 'shutdown_returns' - 'batch'
                          || lockgate._history_mark(dl.headers)
                     -- The job keeps its id in the headers.
                     ELSE dl.headers - 'returns' - 'retry_at' - 'attempts_before' - 'unstarted' - 'shutdown_returns' - 'batch'
                          || lockgate._history_mark(dl.headers)
                          || jsonb_build_object('job_id', dl.job_id,
                                                'enqueued_at', COALESCE(dl.headers->'enqueued_at', to_jsonb(dl.enqueued_at))) END,
                new_msg_id;
        DELETE FROM lockgate.dead_letters x WHERE x.id = dl.id;
        PERFORM pg_notify('lockgate_' || dl.queue, '');
        msg_id := new_msg_id;
        job_id := dl.job_id;
        status := 'enqueued';
        RETURN NEXT;
    END LOOP;
END $$;

-- The form of revisions before 49 (and of SQL users who do not ask for busy rows), kept under its
-- signature so that its grants and the calls of older processes stay as they were.
CREATE OR REPLACE FUNCTION lockgate.dlq_retry(only_queue text DEFAULT NULL, job_ids bigint[] DEFAULT NULL)
RETURNS TABLE (queue text, msg_id bigint, job_id bigint, status text) LANGUAGE sql AS $$
    SELECT * FROM lockgate.dlq_retry(only_queue, job_ids, false)
$$;

CREATE OR REPLACE FUNCTION lockgate.dlq_purge(only_queue text DEFAULT NULL, job_ids bigint[] DEFAULT NULL)
RETURNS bigint LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM lockgate.dead_letters d
         WHERE (dlq_purge.only_queue IS NULL OR d.queue = dlq_purge.only_queue)
           AND (dlq_purge.job_ids IS NULL OR d.job_id = ANY (dlq_purge.job_ids)
                OR (d.job_id IS NULL AND d.msg_id = ANY (dlq_purge.job_ids)))
        RETURNING 1)
    SELECT count(*) FROM gone
$$;
