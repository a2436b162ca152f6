-- The message of job_id in a queue or archive table (tbl, as _queue_table returns it): by msg_id
-- for a job on its first message, by the headers' job_id (partial index) for one sent again;
-- stamp is the column named by stamp_column (vt for a queue, archived_at for an archive).
CREATE OR REPLACE FUNCTION lockgate._job_message(tbl text, stamp_column text, job_id bigint)
RETURNS TABLE (msg_id bigint, read_ct integer, enqueued_at timestamptz, stamp timestamptz, message jsonb, headers jsonb)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY EXECUTE format(
        'SELECT x.msg_id, x.read_ct, x.enqueued_at, x.%2$I, x.message, x.headers FROM %1$s x
          WHERE x.msg_id = $1 AND NOT (x.headers ? ''job_id'')
         UNION ALL
         SELECT x.msg_id, x.read_ct, x.enqueued_at, x.%2$I, x.message, x.headers FROM %1$s x
          WHERE x.headers ? ''job_id'' AND x.headers->>''job_id'' = $1::text
         LIMIT 1', tbl, stamp_column)
      USING job_id;
END $$;

-- One job by id, in whatever state it is (issue 12): queued, scheduled, running, retrying (a
-- failed attempt waiting for its backoff), parked, succeeded (archived), discarded (a
-- while_executing duplicate archived unrun) or dead (dead-lettered). Every lookup is an index
-- lookup: by msg_id (a job on its first message) or by the headers' job_id (a job sent again as a
-- new message; partial index per queue and archive, sql/001_queues.sql), parked and dead
-- letters by their job_id index. The queue tables come first, then the parked jobs, the dead
-- letters and the archives, so a job retried from the dead letters shows where it is now.
-- attempt: the attempt its current or next delivery is (deliveries minus returns, plus the
-- attempts of its earlier messages); errors: every failed attempt, with its time.
-- Locks: none. Callers: lockgate job show, Client::job, SQL operators.
CREATE OR REPLACE FUNCTION lockgate.job(job_id bigint)
RETURNS TABLE (id bigint, state text, queue text, job_type text, args jsonb, priority integer, msg_id bigint,
               attempt integer, enqueued_at timestamptz, visible_at timestamptz, finished_at timestamptz,
               concurrency_key text, errors jsonb, reason text, error text, headers jsonb)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    q text;
    m record;
    p lockgate.parked;
    d lockgate.dead_letters;
BEGIN
    id := job_id;
    FOREACH q IN ARRAY ARRAY(SELECT lockgate._live_queues()) LOOP
        SELECT * INTO m FROM lockgate._job_message(lockgate._queue_table(q, 'q'), 'vt', job_id);
        IF m.msg_id IS NOT NULL THEN
            queue := q;
            state := CASE WHEN m.stamp <= clock_timestamp() THEN 'queued'
                          WHEN jsonb_typeof(m.headers) = 'object' AND m.headers ? 'retry_at' THEN 'retrying'
                          WHEN m.read_ct = 0 THEN 'scheduled'
                          ELSE 'running' END;
            visible_at := m.stamp;
            SELECT f.* INTO job_type, args, priority, msg_id, attempt, enqueued_at, concurrency_key, errors, headers
              FROM lockgate._job_fields(m.message, m.headers, m.msg_id, m.read_ct, m.enqueued_at) f;
            RETURN NEXT;
            RETURN;
        END IF;
    END LOOP;
    SELECT * INTO p FROM lockgate.parked x WHERE x.job_id = job.job_id LIMIT 1;
    IF FOUND THEN
        state := 'parked';
        queue := p.queue;
        visible_at := p.run_at;
        SELECT f.* INTO job_type, args, priority, msg_id, attempt, enqueued_at, concurrency_key, errors, headers
          FROM lockgate._job_fields(p.args, p.headers, NULL, 0, p.parked_at) f;
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT * INTO d FROM lockgate.dead_letters x WHERE x.job_id = job.job_id ORDER BY x.id DESC LIMIT 1;
    IF FOUND THEN
        state := 'dead';
        queue := d.queue;
        finished_at := d.dead_at;
        reason := d.reason;
        error := d.error;
        SELECT f.* INTO job_type, args, priority, msg_id, attempt, enqueued_at, concurrency_key, errors, headers
          FROM lockgate._job_fields(d.args, d.headers, d.msg_id, 0, d.enqueued_at) f;
        attempt := d.attempts;
        RETURN NEXT;
        RETURN;
    END IF;
    FOREACH q IN ARRAY ARRAY(SELECT lockgate._live_queues()) LOOP
        SELECT * INTO m FROM lockgate._job_message(lockgate._queue_table(q, 'a'), 'archived_at', job_id);
        IF m.msg_id IS NOT NULL THEN
            queue := q;
            state := CASE WHEN jsonb_typeof(m.headers) = 'object' AND m.headers ? 'duplicate_of' THEN 'discarded'
                          ELSE 'succeeded' END;
            finished_at := m.stamp;
            SELECT f.* INTO job_type, args, priority, msg_id, attempt, enqueued_at, concurrency_key, errors, headers
              FROM lockgate._job_fields(m.message, m.headers, m.msg_id, m.read_ct, m.enqueued_at) f;
            RETURN NEXT;
            RETURN;
        END IF;
    END LOOP;
END $$;

-- The fields of a job read from its message (or parked row, or dead letter), defensively: a
-- message that is not lockgate's still shows, with NULLs where its headers say nothing usable.
CREATE OR REPLACE FUNCTION lockgate._job_fields(message jsonb, headers jsonb, msg_id bigint, read_ct integer,
                                                stored_at timestamptz,
    OUT job_type text, OUT args jsonb, OUT priority integer, OUT msg_id_out bigint, OUT attempt integer,
    OUT enqueued_at timestamptz, OUT concurrency_key text, OUT errors jsonb, OUT headers_out jsonb)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    h jsonb := CASE WHEN jsonb_typeof(headers) = 'object' THEN headers ELSE '{}' END;
    count_of text := '^[0-9]{1,9}$';
BEGIN
    job_type := h->>'type';
    args := message;
    priority := CASE WHEN h->>'priority' ~ '^[0-9]$' THEN (h->>'priority')::integer ELSE 0 END;
    msg_id_out := msg_id;
    attempt := GREATEST(read_ct
        - CASE WHEN h->>'returns' ~ count_of THEN (h->>'returns')::integer ELSE 0 END
        + CASE WHEN h->>'attempts_before' ~ count_of THEN (h->>'attempts_before')::integer ELSE 0 END, 0);
    enqueued_at := stored_at;
    IF jsonb_typeof(h->'enqueued_at') = 'string' THEN
        BEGIN
            enqueued_at := (h->>'enqueued_at')::timestamptz;
        EXCEPTION WHEN OTHERS THEN
            enqueued_at := stored_at;
        END;
    END IF;
    concurrency_key := h->>'ckey';
    errors := COALESCE(h->'errors', '[]');
    headers_out := headers;
END $$;
