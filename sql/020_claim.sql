-- Claim: take up to qty visible messages of a queue, lowest priority value first, then the one
-- visible longest (its scheduled time, or its retry time), then the oldest, making them
-- invisible for vt_seconds and incrementing read_ct. Each returned row is one
-- delivery; (queue, msg_id, read_ct) is its fencing token for every later step.
-- A claimed job of a limited type whose lease is gone takes a permit again or is parked
-- (lockgate._reacquire), and is then not returned: nothing runs without its permit (G3).
-- One priority at a time, through the claim index (priority, vt, msg_id): within a priority the
-- visible messages come first, so a claim never scans the delayed or in-flight ones after them.
-- Each statement finds the next priority holding a visible message (one index probe per
-- priority, stopping at the first) and claims from it; with every job at one priority, a full
-- claim is one statement.
-- Locks: FOR UPDATE SKIP LOCKED on the claimed rows, so concurrent claimers never wait or collide.
-- Each claimed message records its owner (the claiming process's supervisor id, or NULL), so
-- pruning a dead process can make its in-flight jobs visible at once.
-- Callers: the worker's fetch loop. qty = batch size, vt_seconds = visibility timeout.
CREATE OR REPLACE FUNCTION lockgate.claim(queue text, qty integer, vt_seconds double precision, owner bigint DEFAULT NULL)
RETURNS TABLE (msg_id bigint, read_ct integer, enqueued_at timestamptz, message jsonb, headers jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    tbl text := lockgate._queue_table(queue, 'q');
    r record;
    -- The priority claimed from last; each statement takes the next one holding a visible message.
    after integer := -1;
    got integer;
    left_to_claim integer := qty;
    -- Bound as a value, not called in the statements: clock_timestamp() is volatile, so a
    -- condition on it could not bound the index scan.
    at timestamptz := clock_timestamp();
BEGIN
    WHILE left_to_claim > 0 AND after < 9 LOOP
        got := 0;
        FOR r IN EXECUTE format(
            'WITH best AS (
                 -- A LATERAL probe with its own LIMIT: the planner cannot turn it into a semi-join
                 -- over the whole table, as it may an EXISTS when most messages are visible.
                 SELECT p FROM generate_series($5 + 1, 9) p
                  CROSS JOIN LATERAL (SELECT 1 FROM %1$s m
                                       WHERE COALESCE((m.headers->>''priority'')::smallint, 0) = p AND m.vt <= $4
                                       LIMIT 1) visible
                  LIMIT 1),
             next AS (
                 SELECT m.msg_id FROM %1$s m
                  WHERE COALESCE((m.headers->>''priority'')::smallint, 0) = (SELECT best.p FROM best) AND m.vt <= $4
                  ORDER BY COALESCE((m.headers->>''priority'')::smallint, 0), m.vt, m.msg_id
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
             RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.message, m.headers, (SELECT best.p FROM best) AS p',
            tbl)
          USING left_to_claim, vt_seconds, owner, at, after
        LOOP
            got := got + 1;
            after := r.p;
            left_to_claim := left_to_claim - 1;
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
        -- Nothing visible (or all of it locked by other claimers) at any later priority.
        EXIT WHEN got = 0;
    END LOOP;
END $$;
