-- Dead-letter operations. Filters: only_queue (NULL = every queue) and job_ids (NULL = every job).
-- dlq_retry sends each matching dead letter back to its queue as a new message with the same
-- job id and attempt history (its attempt count starts again), then removes the dead letter,
-- in one transaction. dlq_purge deletes them for good (an operator's explicit discard).
-- Locks: the dead_letters rows (SKIP LOCKED: two operators never retry the same row twice).
-- Callers: lockgate dlq retry|purge, the dashboard, SQL operators.
CREATE OR REPLACE FUNCTION lockgate.dlq_retry(only_queue text DEFAULT NULL, job_ids bigint[] DEFAULT NULL)
RETURNS TABLE (queue text, msg_id bigint, job_id bigint) LANGUAGE plpgsql AS $$
DECLARE
    dl record;
    new_msg_id bigint;
BEGIN
    FOR dl IN
        DELETE FROM lockgate.dead_letters d
         WHERE d.id IN (SELECT x.id FROM lockgate.dead_letters x
                         WHERE (dlq_retry.only_queue IS NULL OR x.queue = dlq_retry.only_queue)
                           AND (dlq_retry.job_ids IS NULL OR x.job_id = ANY (dlq_retry.job_ids))
                         ORDER BY x.id FOR UPDATE SKIP LOCKED)
        RETURNING d.*
    LOOP
        EXECUTE format('INSERT INTO %s (vt, message, headers) VALUES (clock_timestamp(), $1, $2) RETURNING msg_id',
                       lockgate._queue_table(dl.queue, 'q'))
           INTO new_msg_id
          USING dl.args,
                CASE WHEN jsonb_typeof(dl.headers) <> 'object' THEN dl.headers
                     WHEN dl.job_id IS NULL THEN dl.headers - 'returns' - 'retry_at' - 'attempts_before' - 'unstarted'
                     -- A new message with a fresh set of attempts: the job keeps its id in the headers.
                     ELSE dl.headers - 'returns' - 'retry_at' - 'attempts_before' - 'unstarted'
                          || jsonb_build_object('job_id', dl.job_id) END;
        PERFORM pg_notify('lockgate_' || dl.queue, '');
        queue := dl.queue;
        msg_id := new_msg_id;
        job_id := dl.job_id;
        RETURN NEXT;
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION lockgate.dlq_purge(only_queue text DEFAULT NULL, job_ids bigint[] DEFAULT NULL)
RETURNS bigint LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM lockgate.dead_letters d
         WHERE (dlq_purge.only_queue IS NULL OR d.queue = dlq_purge.only_queue)
           AND (dlq_purge.job_ids IS NULL OR d.job_id = ANY (dlq_purge.job_ids))
        RETURNING 1)
    SELECT count(*) FROM gone
$$;
