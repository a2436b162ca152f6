-- Jobs: one job by id (lockgate.job), a search over every state (lockgate.jobs), and the job's
-- life as a list of attempts (issue 12).
--
-- A job lives in one place at a time: a queue table (queued, scheduled, running, retrying), the
-- parked jobs, the dead letters, or a queue's archive (succeeded, discarded, cancelled). Its id is
-- the msg_id of its first message, carried in the headers' job_id when it is sent again as a new
-- message (promoted, re-parked at claim, retried from the dead letters).
--
-- Attempts: a failed attempt is recorded when it fails (retry, dead_letter: its start, end,
-- process and error, in the headers' errors), a cancelled running attempt when it is cancelled;
-- a succeeded or running attempt is derived from the message itself (its last_read_at, its
-- archive time, its owner), so a completion writes nothing more than it did before the history
-- existed (docs/design.md).

-- The state of a message in a queue table: visible now, or put back for a moment because its
-- key was busy (queued), waiting out a retry's backoff (retrying), never delivered and not yet
-- visible (scheduled), or delivered and invisible (running: claimed, perhaps claimed ahead and
-- not yet started).
CREATE OR REPLACE FUNCTION lockgate._queued_state(vt timestamptz, headers jsonb, read_ct integer)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN vt <= clock_timestamp() THEN 'queued'
                WHEN jsonb_typeof(headers) = 'object' AND headers ? 'retry_at'
                 AND headers->'retry_at' IS NOT DISTINCT FROM headers->'put_back_until' THEN 'queued'
                WHEN jsonb_typeof(headers) = 'object' AND headers ? 'retry_at' THEN 'retrying'
                WHEN read_ct = 0 THEN 'scheduled'
                ELSE 'running' END
$$;

-- The state of an archived message: a cancelled job (even a duplicate cancelled before its
-- worker archived it), a while_executing duplicate archived unrun (discarded), or a succeeded one.
CREATE OR REPLACE FUNCTION lockgate._archived_state(headers jsonb)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(headers) <> 'object' THEN 'succeeded'
                WHEN headers ? 'cancelled_at' THEN 'cancelled'
                WHEN headers ? 'duplicate_of' THEN 'discarded'
                ELSE 'succeeded' END
$$;

-- When a job was first enqueued: its headers' enqueued_at (kept across promotion and dead-letter
-- retries) when well formed, else when its row was stored.
CREATE OR REPLACE FUNCTION lockgate._first_enqueued_at(headers jsonb, stored_at timestamptz)
RETURNS timestamptz LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF jsonb_typeof(headers) IS DISTINCT FROM 'object' OR jsonb_typeof(headers->'enqueued_at') IS DISTINCT FROM 'string'
       OR headers->>'enqueued_at' !~ '^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?([+-]\d\d(:\d\d)?|Z)$' THEN
        RETURN stored_at;
    END IF;
    -- A well-shaped but impossible time (month 13) is not lockgate's: the stored time stands.
    BEGIN
        RETURN (headers->>'enqueued_at')::timestamptz;
    EXCEPTION WHEN datetime_field_overflow OR invalid_datetime_format THEN
        RETURN stored_at;
    END;
END $$;

-- The attempts of a job's earlier messages (headers read defensively).
CREATE OR REPLACE FUNCTION lockgate._attempts_before(headers jsonb)
RETURNS integer LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(headers) = 'object' AND headers->>'attempts_before' ~ '^[0-9]{1,9}$'
                THEN (headers->>'attempts_before')::integer ELSE 0 END
$$;

-- The attempt a delivery of read_ct is: deliveries minus shutdown returns that were not
-- attempts, plus the attempts of the job's earlier messages (headers read defensively; counts
-- written by hand past an integer are held at its largest).
CREATE OR REPLACE FUNCTION lockgate._attempt_of(headers jsonb, read_ct integer)
RETURNS integer LANGUAGE sql IMMUTABLE AS $$
    SELECT LEAST(GREATEST(read_ct::bigint
        - CASE WHEN jsonb_typeof(headers) = 'object' AND headers->>'returns' ~ '^[0-9]{1,9}$'
               THEN (headers->>'returns')::integer ELSE 0 END
        + lockgate._attempts_before(headers), 0), 2147483647)::integer
$$;

-- Where this life of a job's attempt history starts: the number of entries of the headers'
-- errors written before its last dead-letter retry (history_from, which dlq_retry sets; attempt
-- numbers start again after it), or 0.
CREATE OR REPLACE FUNCTION lockgate._history_from(headers jsonb)
RETURNS integer LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(headers) = 'object' AND headers->>'history_from' ~ '^[0-9]{1,9}$'
                THEN (headers->>'history_from')::integer ELSE 0 END
$$;

-- The last attempt of a message in state `state` that should have an outcome recorded, or be
-- lost: its current delivery's when that delivery ran and is no longer running (a succeeded or
-- running one is read from the message itself; one claimed ahead and never started, with no
-- last_read_at, is no attempt: the next claim counts it as a return).
CREATE OR REPLACE FUNCTION lockgate._lost_upto(headers jsonb, read_ct integer, state text, last_read_at timestamptz)
RETURNS integer LANGUAGE sql IMMUTABLE AS $$
    SELECT lockgate._attempt_of(headers, read_ct)
           - CASE WHEN state IN ('succeeded', 'running') OR last_read_at IS NULL THEN 1 ELSE 0 END
$$;

-- headers with the attempt history written down for a message that leaves its queue table
-- (parked again at claim, dead-lettered), where read_ct no longer tells of its attempts: an
-- entry 'lost' for each attempt numbered after `after` and up to `upto` that this life recorded
-- nothing for (its worker was killed, or lost its lease and stopped), at most the last 100, and
-- this life's entries in attempt order (review helper-84, F4). Malformed headers or histories are
-- returned as they are, and so is a history whose attempt numbers go down after the mark: a
-- job a build before the mark retried from the dead letters, whose lives cannot be told apart
-- (review helper-88: sorted together, the two lives were interleaved for good).
CREATE OR REPLACE FUNCTION lockgate._record_lost(headers jsonb, after integer, upto integer)
RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN jsonb_typeof(headers) <> 'object' OR jsonb_typeof(COALESCE(headers->'errors', '[]')) <> 'array'
          OR upto <= after THEN headers
        WHEN EXISTS (SELECT 1 FROM (SELECT n, lag(n) OVER (ORDER BY o) AS prev
                                      FROM (SELECT o, (e->>'attempt')::numeric AS n
                                              FROM jsonb_array_elements(headers->'errors') WITH ORDINALITY a(e, o)
                                             WHERE o > lockgate._history_from(headers)
                                               AND jsonb_typeof(e->'attempt') = 'number') numbered) t
                      WHERE t.n < t.prev) THEN headers
        ELSE headers || jsonb_build_object('errors',
            COALESCE((SELECT jsonb_agg(e ORDER BY o) FROM jsonb_array_elements(headers->'errors') WITH ORDINALITY a(e, o)
                       WHERE o <= lockgate._history_from(headers)), '[]')
            || COALESCE((SELECT jsonb_agg(e ORDER BY n NULLS FIRST, o)
                   FROM (SELECT e, o, CASE WHEN jsonb_typeof(e->'attempt') = 'number' AND e->>'attempt' ~ '^[0-9]{1,9}$'
                                           THEN (e->>'attempt')::integer END AS n
                           FROM jsonb_array_elements(headers->'errors') WITH ORDINALITY a(e, o)
                          WHERE o > lockgate._history_from(headers)
                         UNION ALL
                         SELECT jsonb_build_object('attempt', g, 'started_at', NULL, 'at', NULL, 'process', NULL,
                                                   'outcome', 'lost',
                                                   'error', 'no outcome was recorded: its worker stopped (killed, or its lease was lost)'),
                                NULL, g
                           FROM generate_series(GREATEST(after + 1, upto - 99), upto) g
                          WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(headers->'errors') WITH ORDINALITY r(e, o)
                                             WHERE r.o > lockgate._history_from(headers)
                                               AND jsonb_typeof(r.e->'attempt') = 'number'
                                               AND (r.e->>'attempt')::numeric = g)) x), '[]'))
        END
$$;

-- The fields of a job read from its message (or parked row, or dead letter), defensively: a
-- message that is not lockgate's still shows, with NULLs where its headers say nothing usable,
-- and the priority as its claim ranks it (lockgate._rank_sql): 0 when there is none, -1 when it
-- is not one of 0..9 (such a message is dead-lettered by the next claim of its queue, H29), the
-- digit for a JSON string of one digit ("5": dead-lettered when that priority's turn comes).
-- attempts: every recorded attempt (failed or cancelled), then the one the row itself tells of:
-- a succeeded job's last (its start and archive time), a running job's current once started.
CREATE OR REPLACE FUNCTION lockgate._job_fields(message jsonb, headers jsonb, read_ct integer, stored_at timestamptz,
                                                state text, last_read_at timestamptz, finished_at timestamptz,
    OUT job_type text, OUT args jsonb, OUT priority integer, OUT attempt integer,
    OUT enqueued_at timestamptz, OUT concurrency_key text, OUT attempts jsonb)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    h jsonb := CASE WHEN jsonb_typeof(headers) = 'object' THEN headers ELSE '{}' END;
BEGIN
    job_type := h->>'type';
    args := message;
    priority := CASE WHEN h->>'priority' IS NULL THEN 0 WHEN h->>'priority' ~ '^[0-9]$' THEN (h->>'priority')::integer ELSE -1 END;
    attempt := lockgate._attempt_of(h, read_ct);
    enqueued_at := lockgate._first_enqueued_at(h, stored_at);
    concurrency_key := h->>'ckey';
    -- An attempt that started and recorded no outcome (its worker was killed, or lost its lease
    -- and stopped) is shown as lost, so that there is one entry per attempt (review helper-81).
    -- Only a message's own deliveries can be told apart so (parked jobs and dead letters are read
    -- with read_ct 0, and had theirs written when they left their queue table; a cancelled or
    -- discarded job's had theirs written when archived): the attempts after the job's earlier
    -- messages' (attempts_before), up to lockgate._lost_upto. At most the last 100 of them, for
    -- counts written by hand (review helper-83: an attempts_before of 999999999 hung every listing).
    IF read_ct > 0 AND state IN ('queued', 'scheduled', 'retrying', 'running', 'succeeded') THEN
        h := lockgate._record_lost(h, lockgate._attempts_before(h), lockgate._lost_upto(h, read_ct, state, last_read_at));
    END IF;
    SELECT COALESCE(jsonb_agg(jsonb_build_object(
               'attempt', e->'attempt', 'started_at', e->'started_at', 'ended_at', COALESCE(e->'ended_at', e->'at'),
               'process', e->'process', 'outcome', COALESCE(e->'outcome', '"failed"'), 'error', e->'error')
             ORDER BY o), '[]')
      INTO attempts
      FROM jsonb_array_elements(CASE WHEN jsonb_typeof(h->'errors') = 'array' THEN h->'errors' ELSE '[]' END)
           WITH ORDINALITY AS a(e, o)
     WHERE jsonb_typeof(e) = 'object';
    IF state = 'succeeded' OR (state = 'running' AND last_read_at IS NOT NULL) THEN
        attempts := attempts || jsonb_build_array(jsonb_build_object(
            'attempt', attempt, 'started_at', last_read_at, 'ended_at', finished_at, 'process', h->'owner',
            'outcome', state, 'error', NULL));
    END IF;
END $$;

-- Whether one of the errors recorded in headers (an attempt's error, not the keys or times of
-- the history) contains text, case-insensitively.
CREATE OR REPLACE FUNCTION lockgate._errors_mention(headers jsonb, text text)
RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_typeof(headers) = 'object' AND jsonb_typeof(headers->'errors') = 'array'
       AND EXISTS (SELECT 1 FROM jsonb_array_elements(headers->'errors') e
                    WHERE jsonb_typeof(e) = 'object' AND strpos(lower(e->>'error'), lower(text)) > 0)
$$;

-- The jobs of one queue table or archive (kind 'q' or 'a'), filtered, newest id first. Every
-- filter is a bound value; NULL matches anything. only_id finds one job through the indexes
-- (by msg_id, or the headers' job_id); otherwise the table is scanned, with the cheap filters
-- and the id order taken on the raw rows and the job's fields read only for the rows returned.
CREATE OR REPLACE FUNCTION lockgate._jobs_in_queue(queue text, kind text, only_id bigint, job_type text, states text[],
                                                   key text, since timestamptz, until timestamptz, search text,
                                                   before_id bigint, max_rows integer)
RETURNS SETOF lockgate.job_info LANGUAGE plpgsql STABLE AS $$
DECLARE
    tbl text := lockgate._queue_table(queue, kind);
    source text;
    state_of text := CASE kind WHEN 'q' THEN 'lockgate._queued_state(x.vt, x.headers, x.read_ct)'
                               ELSE 'lockgate._archived_state(x.headers)' END;
BEGIN
    IF states IS NOT NULL AND NOT states && (CASE kind WHEN 'q' THEN ARRAY['queued', 'scheduled', 'running', 'retrying']
                                                     ELSE ARRAY['succeeded', 'discarded', 'cancelled'] END) THEN
        RETURN;
    END IF;
    source := CASE WHEN only_id IS NULL THEN format('SELECT * FROM %s', tbl)
                   ELSE format('SELECT * FROM %1$s WHERE msg_id = $1 AND lockgate._job_id_of(headers) IS NULL
                                UNION ALL
                                SELECT * FROM %1$s WHERE headers ? ''job_id'' AND headers->>''job_id'' = $1::text', tbl) END;
    RETURN QUERY EXECUTE format(
        'SELECT r.id, r.state, $11, f.job_type, f.args, f.priority, r.msg_id, f.attempt, f.enqueued_at,
                r.visible_at, r.finished_at, f.concurrency_key, f.attempts, NULL::text, NULL::text, r.headers
           FROM (SELECT COALESCE(lockgate._job_id_of(x.headers), x.msg_id) AS id, %2$s AS state, x.msg_id,
                        x.read_ct, x.enqueued_at, x.last_read_at, x.message, x.headers,
                        %3$s AS visible_at, %4$s AS finished_at
                   FROM (%1$s) x
                  WHERE ($2::text IS NULL OR x.headers->>''type'' = $2)
                    AND ($3::text[] IS NULL OR %2$s = ANY ($3))
                    AND ($4::text IS NULL OR x.headers->>''ckey'' = $4 OR x.headers->>''ukey'' = $4 OR x.headers->>''wkey'' = $4)
                    AND ($5::timestamptz IS NULL OR lockgate._first_enqueued_at(x.headers, x.enqueued_at) >= $5)
                    AND ($6::timestamptz IS NULL OR lockgate._first_enqueued_at(x.headers, x.enqueued_at) < $6)
                    AND ($7::text IS NULL OR strpos(lower(x.message::text), lower($7)) > 0
                         OR lockgate._errors_mention(x.headers, $7))
                    AND ($8::bigint IS NULL OR COALESCE(lockgate._job_id_of(x.headers), x.msg_id) < $8)
                  ORDER BY 1 DESC LIMIT $9) r
          CROSS JOIN LATERAL lockgate._job_fields(r.message, r.headers, r.read_ct, r.enqueued_at, r.state,
                                                  r.last_read_at, r.finished_at) f
          ORDER BY r.id DESC',
        source, state_of,
        CASE kind WHEN 'q' THEN 'x.vt' ELSE 'NULL::timestamptz' END,
        CASE kind WHEN 'q' THEN 'NULL::timestamptz' ELSE 'x.archived_at' END)
      USING only_id, job_type, states, key, since, until, search, before_id, max_rows, kind, queue;
END $$;

-- The parked jobs (state parked), filtered like _jobs_in_queue; only_queue NULL for every queue.
CREATE OR REPLACE FUNCTION lockgate._jobs_parked(only_queue text, only_id bigint, job_type text, key text,
                                                 since timestamptz, until timestamptz, search text,
                                                 before_id bigint, max_rows integer)
RETURNS SETOF lockgate.job_info LANGUAGE sql STABLE AS $$
    SELECT p.job_id, 'parked', p.queue, f.job_type, f.args, f.priority, NULL::bigint, f.attempt, f.enqueued_at,
           p.run_at, NULL::timestamptz, f.concurrency_key, f.attempts, NULL::text, NULL::text, p.headers
      FROM (SELECT x.* FROM lockgate.parked x
             WHERE (only_id IS NULL OR x.job_id = only_id)
               AND (only_queue IS NULL OR x.queue = only_queue)
               AND (_jobs_parked.job_type IS NULL OR x.job_type = _jobs_parked.job_type)
               AND (_jobs_parked.key IS NULL OR x.key = _jobs_parked.key OR x.headers->>'ukey' = _jobs_parked.key
                    OR x.headers->>'wkey' = _jobs_parked.key)
               AND (since IS NULL OR lockgate._first_enqueued_at(x.headers, x.parked_at) >= since)
               AND (until IS NULL OR lockgate._first_enqueued_at(x.headers, x.parked_at) < until)
               AND (search IS NULL OR strpos(lower(x.args::text), lower(search)) > 0
                    OR lockgate._errors_mention(x.headers, search))
               AND (before_id IS NULL OR x.job_id < before_id)
             ORDER BY x.job_id DESC LIMIT max_rows) p
     CROSS JOIN LATERAL lockgate._job_fields(p.args, p.headers, 0, p.parked_at, 'parked', NULL, NULL) f
     ORDER BY p.job_id DESC
$$;

-- The dead letters (state dead), filtered like _jobs_in_queue. A job dead-lettered more than once
-- (retried from the dead letters, dead again) shows its latest dead letter.
CREATE OR REPLACE FUNCTION lockgate._jobs_dead(only_queue text, only_id bigint, job_type text, key text,
                                               since timestamptz, until timestamptz, search text,
                                               before_id bigint, max_rows integer)
RETURNS SETOF lockgate.job_info LANGUAGE sql STABLE AS $$
    SELECT d.job, 'dead', d.queue, f.job_type, f.args, f.priority, d.msg_id, d.attempts, f.enqueued_at,
           NULL::timestamptz, d.dead_at, f.concurrency_key, f.attempts, d.reason, d.error, d.headers
      FROM (SELECT DISTINCT ON (COALESCE(x.job_id, x.msg_id)) COALESCE(x.job_id, x.msg_id) AS job, x.*
              FROM lockgate.dead_letters x
             WHERE (only_id IS NULL OR x.job_id = only_id OR (x.job_id IS NULL AND x.msg_id = only_id))
               AND (only_queue IS NULL OR x.queue = only_queue)
               AND (_jobs_dead.job_type IS NULL OR x.job_type = _jobs_dead.job_type)
               AND (_jobs_dead.key IS NULL OR x.headers->>'ckey' = _jobs_dead.key OR x.headers->>'ukey' = _jobs_dead.key
                    OR x.headers->>'wkey' = _jobs_dead.key)
               AND (since IS NULL OR lockgate._first_enqueued_at(x.headers, x.enqueued_at) >= since)
               AND (until IS NULL OR lockgate._first_enqueued_at(x.headers, x.enqueued_at) < until)
               AND (search IS NULL OR strpos(lower(x.args::text), lower(search)) > 0
                    OR strpos(lower(COALESCE(x.error, '')), lower(search)) > 0
                    OR lockgate._errors_mention(x.headers, search))
               AND (before_id IS NULL OR COALESCE(x.job_id, x.msg_id) < before_id)
               AND COALESCE(x.job_id, x.msg_id) IS NOT NULL
             ORDER BY COALESCE(x.job_id, x.msg_id) DESC, x.id DESC LIMIT max_rows) d
     CROSS JOIN LATERAL lockgate._job_fields(d.args, d.headers, 0, d.enqueued_at, 'dead', NULL, d.dead_at) f
     ORDER BY d.job DESC
$$;

-- One job by id, in whatever state it is: queued, scheduled, running, retrying (a failed attempt
-- waiting for its backoff), parked, succeeded, discarded (a while_executing duplicate archived
-- unrun), cancelled, or dead. Every lookup is an index lookup: by msg_id (a job on its first
-- message) or by the headers' job_id (partial index per queue and archive, sql/001_queues.sql),
-- parked and dead letters by their job_id indexes. The queue tables come first, then the parked
-- jobs, the dead letters and the archives, so a job retried from the dead letters shows where it
-- is now. attempt: the attempt its current or next delivery is (deliveries minus returns, plus
-- the attempts of its earlier messages). No row: no such job (or pruned by archive retention),
-- or a NULL id.
-- Locks: none. Callers: lockgate job show, Client::job, lockgate.cancel, SQL operators.
CREATE OR REPLACE FUNCTION lockgate.job(job_id bigint)
RETURNS SETOF lockgate.job_info LANGUAGE plpgsql STABLE STRICT AS $$
DECLARE
    q text;
    found lockgate.job_info;
BEGIN
    FOREACH q IN ARRAY ARRAY(SELECT lockgate._live_queues()) LOOP
        SELECT * INTO found FROM lockgate._jobs_in_queue(q, 'q', job_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1);
        IF found.id IS NOT NULL THEN
            RETURN NEXT found;
            RETURN;
        END IF;
    END LOOP;
    SELECT * INTO found FROM lockgate._jobs_parked(NULL, job_id, NULL, NULL, NULL, NULL, NULL, NULL, 1);
    IF found.id IS NULL THEN
        SELECT * INTO found FROM lockgate._jobs_dead(NULL, job_id, NULL, NULL, NULL, NULL, NULL, NULL, 1);
    END IF;
    IF found.id IS NOT NULL THEN
        RETURN NEXT found;
        RETURN;
    END IF;
    FOREACH q IN ARRAY ARRAY(SELECT lockgate._live_queues()) LOOP
        SELECT * INTO found FROM lockgate._jobs_in_queue(q, 'a', job_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1);
        IF found.id IS NOT NULL THEN
            RETURN NEXT found;
            RETURN;
        END IF;
    END LOOP;
END $$;

-- The states a job can be in, as lockgate.job reports them.
CREATE OR REPLACE FUNCTION lockgate.job_states()
RETURNS text[] LANGUAGE sql IMMUTABLE AS $$
    SELECT ARRAY['scheduled', 'queued', 'running', 'retrying', 'parked', 'succeeded', 'discarded', 'cancelled', 'dead']
$$;

-- Raises LG003 naming the first of states that is not a job state.
CREATE OR REPLACE FUNCTION lockgate._check_states(states text[])
RETURNS void LANGUAGE plpgsql STABLE AS $$
DECLARE
    bad text;
BEGIN
    SELECT s INTO bad FROM unnest(states) s WHERE s IS NULL OR NOT s = ANY (lockgate.job_states()) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'lockgate: invalid job state "%"', COALESCE(bad, 'NULL')
            USING ERRCODE = 'LG003', HINT = 'one of ' || array_to_string(lockgate.job_states(), ', ');
    END IF;
END $$;

-- Jobs matching every filter given (NULL: any), newest id first, at most max_rows (1 to 1000).
-- queue: one queue (LG001 when unknown); job_type (LG002 when no type of that name is defined
-- and nothing matches);
-- states: any of lockgate.job_states() (LG003 otherwise); key: a concurrency or unique key;
-- since/until: first enqueued in [since, until);
-- search: text in the arguments or in an attempt's error (case-insensitive); before_id: the
-- cursor, the last id of the previous page. The id lookup is indexed; a search scans the tables it
-- has to (a state filter skips the others: 'dead' reads only the dead letters), reading the job's
-- fields only for the rows it returns.
-- Locks: none. Callers: lockgate jobs, Client::jobs, lockgate.cancel_jobs, SQL operators.
CREATE OR REPLACE FUNCTION lockgate.jobs(queue text DEFAULT NULL, job_type text DEFAULT NULL, states text[] DEFAULT NULL,
                                         key text DEFAULT NULL, since timestamptz DEFAULT NULL,
                                         until timestamptz DEFAULT NULL, search text DEFAULT NULL,
                                         max_rows integer DEFAULT 50, before_id bigint DEFAULT NULL)
RETURNS SETOF lockgate.job_info LANGUAGE plpgsql STABLE AS $$
DECLARE
    queues text[];
    q text;
    found lockgate.job_info[] := '{}';
BEGIN
    PERFORM lockgate._check_states(states);
    IF max_rows IS NULL OR max_rows NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'lockgate: invalid max_rows %: 1 to 1000', max_rows USING ERRCODE = 'LG003';
    END IF;
    IF since IS NOT NULL AND until IS NOT NULL AND until <= since THEN
        RAISE EXCEPTION 'lockgate: invalid time range: until (%) is not after since (%)', until, since
            USING ERRCODE = 'LG003';
    END IF;
    IF jobs.queue IS NOT NULL THEN
        PERFORM lockgate._queue_table(jobs.queue, 'q');
        queues := ARRAY[jobs.queue];
    ELSE
        queues := ARRAY(SELECT lockgate._live_queues());
    END IF;
    FOREACH q IN ARRAY queues LOOP
        found := found || ARRAY(SELECT j FROM lockgate._jobs_in_queue(q, 'q', NULL, job_type, states, key, since, until,
                                                                      search, before_id, max_rows) j)
                       || ARRAY(SELECT j FROM lockgate._jobs_in_queue(q, 'a', NULL, job_type, states, key, since, until,
                                                                      search, before_id, max_rows) j);
    END LOOP;
    IF states IS NULL OR 'parked' = ANY (states) THEN
        found := found || ARRAY(SELECT j FROM lockgate._jobs_parked(jobs.queue, NULL, job_type, key, since, until, search,
                                                                    before_id, max_rows) j);
    END IF;
    IF states IS NULL OR 'dead' = ANY (states) THEN
        found := found || ARRAY(SELECT j FROM lockgate._jobs_dead(jobs.queue, NULL, job_type, key, since, until, search,
                                                                  before_id, max_rows) j);
    END IF;
    -- A type no one defines that matches nothing is a typo far more often than a search, and
    -- matching nothing in silence told an operator cancelling a misspelt type that nothing ran
    -- (review helper-92): refused as an unknown queue is. A removed type's history, or its jobs
    -- dead-lettered as of an unknown type, are still found (review helper-93).
    IF cardinality(found) = 0 AND jobs.job_type IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM lockgate.job_types t WHERE t.name = jobs.job_type) THEN
        PERFORM lockgate.job_policy(jobs.job_type);  -- raises LG002 naming the type
    END IF;
    RETURN QUERY SELECT * FROM unnest(found) ORDER BY 1 DESC LIMIT max_rows;
END $$;
