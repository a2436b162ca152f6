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
-- The headers a dead letter keeps: the delivery's, less its retry mark, with its last attempt
-- appended to the history. When its attempts are exhausted, the attempts before that recorded
-- nothing (their worker was killed) are written down as lost first: in the dead letter, read_ct
-- no longer tells of them. A delivery that would have been an attempt past the last (its
-- previous attempt was lost, or max_attempts was lowered) is dead-lettered unrun: its entry is
-- its previous attempt's, lost, with no start, in place of a lost entry of that number written
-- when the job was parked again; an attempt with an outcome of its own (failed and retried, or
-- interrupted by a shutdown return) keeps it, and the dead letter's reason and error say the
-- rest (reviews helper-88 and helper-89: one entry per attempt, none dropped). Headers that are
-- not an object are kept as they are.
-- The attempt a dead letter tells of: the one its caller names, except with its attempts
-- exhausted, where it is the delivery's own when that ran, or the one before it when the
-- delivery is past the last attempt and was not run (its previous attempt was lost, or
-- max_attempts was lowered); never one past the delivery's own, whatever its caller names
-- (review helper-90). Also the dead letter's count of attempts made. PL/pgSQL: _attempt_of is
-- created after this file (sql/068_jobs.sql).
CREATE OR REPLACE FUNCTION lockgate._dead_letter_attempt(headers jsonb, read_ct integer, reason text, attempt integer)
RETURNS integer LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    own integer := lockgate._attempt_of(headers, read_ct);
BEGIN
    RETURN CASE WHEN reason <> 'attempts_exhausted' OR jsonb_typeof(headers) IS DISTINCT FROM 'object' THEN attempt
                WHEN own <= attempt THEN own
                ELSE own - 1 END;
END $$;

CREATE OR REPLACE FUNCTION lockgate._dead_letter_headers(headers jsonb, read_ct integer, last_read_at timestamptz,
                                                         reason text, error text, attempt integer)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    h jsonb;
    ran boolean := reason <> 'attempts_exhausted' OR lockgate._attempt_of(headers, read_ct) <= attempt;
    told integer := lockgate._dead_letter_attempt(headers, read_ct, reason, attempt);
    life integer;
BEGIN
    IF jsonb_typeof(headers) IS DISTINCT FROM 'object' THEN
        RETURN headers;
    END IF;
    h := headers - 'retry_at';
    IF reason = 'attempts_exhausted' THEN
        h := lockgate._record_lost(h, lockgate._attempts_before(h), told - 1);
    END IF;
    IF NOT ran AND jsonb_typeof(h->'errors') = 'array' THEN
        life := lockgate._history_from(h);
        IF EXISTS (SELECT 1 FROM jsonb_array_elements(h->'errors') WITH ORDINALITY a(e, o)
                    WHERE o > life AND jsonb_typeof(e->'attempt') = 'number' AND (e->>'attempt')::numeric = told
                      AND e->>'outcome' IS DISTINCT FROM 'lost') THEN
            RETURN h;
        END IF;
        h := h || jsonb_build_object('errors', COALESCE(
            (SELECT jsonb_agg(e ORDER BY o) FROM jsonb_array_elements(h->'errors') WITH ORDINALITY a(e, o)
              WHERE NOT (o > life AND jsonb_typeof(e->'attempt') = 'number' AND (e->>'attempt')::numeric = told
                         AND e->>'outcome' = 'lost')), '[]'));
    END IF;
    RETURN h || jsonb_build_object('errors', COALESCE(h->'errors', '[]')
        || jsonb_build_array(jsonb_build_object(
               'attempt', told, 'started_at', CASE WHEN ran THEN last_read_at END, 'at', clock_timestamp(),
               'process', CASE WHEN ran THEN h->'owner' END, 'outcome', CASE WHEN ran THEN 'failed' ELSE 'lost' END,
               'error', error)));
END $$;

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
                lockgate._dead_letter_headers(g.headers, $2, g.last_read_at, $4, left($5, 4000), $6),
                $4, left($5, 4000),
                -- The attempts made: a delivery past a lowered max_attempts, dead-lettered unrun,
                -- made more than the limit its caller names.
                lockgate._dead_letter_attempt(g.headers, $2, $4, $6),
                g.enqueued_at
           FROM gone g
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
            PERFORM lockgate._count_batch_jobs(queue, ARRAY[COALESCE(lockgate._job_id_of(found_headers), found_id)], true,
                                               ARRAY[found_id]);
        END IF;
    END IF;
    RETURN found_id IS NOT NULL;
END $$;
