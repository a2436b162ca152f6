-- Dead-letter: move a delivery's message to lockgate.dead_letters with its reason, its last
-- error appended to the attempt history (after the attempts that recorded nothing, as lost, when
-- its attempts are exhausted), and its attempt count. Fenced on (msg_id, read_ct).
-- The job id is the headers' job_id, or for a job on its first message its msg_id.
-- Header fields are read defensively: this is also the path for messages that are not
-- lockgate's, and it must never fail on them (a message that cannot be dead-lettered would be
-- retried forever). Its permit is given back and the next parked job of its key promoted, its
-- uniqueness lock released and its batch counted as failed, in the same transaction, only when
-- this delivery removed the message; the permit waits for the sweep instead when another
-- transaction holds the key's row (lockgate._release_leases). Returns whether it did.
-- Locks: the deleted row, its lease, the key's semaphore row (only if free), its unique lock, its
-- batch row.
-- Callers: the worker (last attempt failed, undecodable, unknown type).
CREATE OR REPLACE FUNCTION lockgate.dead_letter(
    queue text, msg_id bigint, read_ct integer, reason text, error text, attempts integer
) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    found_id bigint;
    found_headers jsonb;
BEGIN
    EXECUTE format(
        'WITH gone AS (
             DELETE FROM %s m WHERE m.msg_id = $1 AND m.read_ct = $2
             RETURNING m.msg_id, m.message, m.headers, m.enqueued_at, m.last_read_at)
         INSERT INTO lockgate.dead_letters (queue, msg_id, job_id, job_type, args, headers, reason, error, attempts, enqueued_at)
         SELECT $3, g.msg_id,
                CASE WHEN g.headers->>''job_id'' ~ ''^[0-9]{1,18}$'' THEN (g.headers->>''job_id'')::bigint
                     WHEN jsonb_typeof(g.headers) = ''object'' AND g.headers ? ''type'' THEN g.msg_id END,
                CASE WHEN jsonb_typeof(g.headers) = ''object'' THEN g.headers->>''type'' END,
                g.message,
                CASE WHEN jsonb_typeof(g.headers) = ''object''
                     THEN r.headers - ''retry_at'' || jsonb_build_object(''errors'', COALESCE(r.headers->''errors'', ''[]'')
                          || jsonb_build_array(jsonb_build_object(
                                 ''attempt'', $6, ''started_at'', g.last_read_at, ''at'', clock_timestamp(),
                                 ''process'', g.headers->''owner'', ''error'', left($5, 4000))))
                     ELSE g.headers END,
                $4, left($5, 4000), $6, g.enqueued_at
           FROM gone g
          -- The attempts before the last that recorded nothing (their worker was killed) are
          -- written down as lost: in the dead letter, read_ct no longer tells of them.
          CROSS JOIN LATERAL (SELECT lockgate._record_lost(g.headers,
                                  CASE WHEN g.headers->>''attempts_before'' ~ ''^[0-9]{1,9}$''
                                       THEN (g.headers->>''attempts_before'')::integer ELSE 0 END,
                                  CASE WHEN $4 = ''attempts_exhausted'' THEN $6 - 1 ELSE 0 END) AS headers) r
         RETURNING msg_id, headers',
        lockgate._queue_table(queue, 'q'))
       INTO found_id, found_headers
      USING dead_letter.msg_id, dead_letter.read_ct, queue, reason, error, attempts;
    IF found_id IS NOT NULL THEN
        PERFORM lockgate._release_leases(queue, ARRAY[found_id]);
        IF jsonb_typeof(found_headers) = 'object' AND (found_headers ? 'ukey' OR found_headers ? 'wkey') THEN
            PERFORM lockgate._release_unique(queue, ARRAY[COALESCE(lockgate._job_id_of(found_headers), found_id)],
                                             ARRAY[found_id]);
        END IF;
        IF jsonb_typeof(found_headers) = 'object' AND found_headers ? 'batch' THEN
            PERFORM lockgate._count_batch_jobs(queue, ARRAY[COALESCE(lockgate._job_id_of(found_headers), found_id)], true);
        END IF;
    END IF;
    RETURN found_id IS NOT NULL;
END $$;
