-- Claim: take up to qty visible messages of a queue, lowest priority value first, then oldest,
-- making them invisible for vt_seconds and incrementing read_ct. Each returned row is one
-- delivery; (queue, msg_id, read_ct) is its fencing token for every later step.
-- A claimed job of a limited type whose lease is gone takes a permit again or is parked
-- (lockgate._reacquire), and is then not returned: nothing runs without its permit (G3).
-- Locks: FOR UPDATE SKIP LOCKED on the claimed rows, so concurrent claimers never wait or collide.
-- Each claimed message records its owner (the claiming process's supervisor id, or NULL), so
-- pruning a dead process can make its in-flight jobs visible at once.
-- Callers: the worker's fetch loop. qty = batch size, vt_seconds = visibility timeout.
CREATE OR REPLACE FUNCTION lockgate.claim(queue text, qty integer, vt_seconds double precision, owner bigint DEFAULT NULL)
RETURNS TABLE (msg_id bigint, read_ct integer, enqueued_at timestamptz, message jsonb, headers jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    FOR r IN EXECUTE format(
        'WITH next AS (
             SELECT m.msg_id FROM %1$s m
              WHERE m.vt <= clock_timestamp()
              ORDER BY COALESCE((m.headers->>''priority'')::smallint, 0), m.msg_id
              LIMIT $1
                FOR UPDATE SKIP LOCKED)
         UPDATE %1$s m
            SET vt = clock_timestamp() + make_interval(secs => $2),
                read_ct = m.read_ct + 1,
                last_read_at = clock_timestamp(),
                headers = CASE WHEN $3 IS NULL OR jsonb_typeof(m.headers) <> ''object'' THEN m.headers
                               ELSE m.headers || jsonb_build_object(''owner'', $3) END
           FROM next
          WHERE m.msg_id = next.msg_id
         RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.message, m.headers',
        lockgate._queue_table(queue, 'q'))
      USING qty, vt_seconds, owner
    LOOP
        IF r.headers ? 'ckey'
           AND NOT EXISTS (SELECT 1 FROM lockgate.leases l WHERE l.queue = claim.queue AND l.msg_id = r.msg_id)
           AND NOT lockgate._reacquire(claim.queue, r.msg_id, r.read_ct, r.message, r.headers) THEN
            CONTINUE;
        END IF;
        msg_id := r.msg_id;
        read_ct := r.read_ct;
        enqueued_at := r.enqueued_at;
        message := r.message;
        headers := r.headers;
        RETURN NEXT;
    END LOOP;
END $$;
