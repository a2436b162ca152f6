-- A queue's claim step, generated with its table's name written in (docs/design.md §54):
-- lockgate._claim_take_<queue>(qty, vt_seconds, owner, at, start_now, queue) claims up to qty
-- visible messages, one priority at a time, best first. A statement on a table named at run
-- time is dynamic SQL, planned at every call, and planning the claim statement cost more than
-- running it; in a function of its own, PL/pgSQL plans it once per session. One step, not a
-- probe and a take called in turn: each dynamic call is parsed and planned at every claim, so
-- a claim makes one (docs/design.md §56). Written by lockgate.create_queue, for every queue
-- each time the functions are installed (the end of this file), and by a claim that finds it
-- missing, through lockgate._write_step (sql/001_queues.sql: idempotent, without a lock when
-- nothing changes; a step planted by another role is never kept), which also drops the probe
-- step of functions revisions 11 to 18.
-- SECURITY DEFINER: the step belongs to the role that installed lockgate's functions (the one
-- that runs migrate), whoever creates the queue or claims, so that no other role needs CREATE
-- on schema lockgate and a later migrate may write it again. Every argument of its calls is
-- typed, so no overload another role might add under a called function's name is a better
-- match, to run as the installer.
-- Locks: none when nothing changes; else the queue name's advisory lock, then catalog rows.
-- Callers: create_queue, migrate, lockgate.claim.
CREATE OR REPLACE FUNCTION lockgate._install_claim_steps(queue text)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET client_min_messages = warning AS $$
DECLARE
    tbl text := lockgate._queue_table(queue, 'q'::text);
    body text;
BEGIN
    -- Messages of the best priority holding a visible message, visible longest first, then
    -- oldest, skipping rows other claimers hold; then the next priority's, while fewer than qty
    -- were taken (what was visible at one priority may all have been taken by other claimers
    -- meanwhile). The first start_now of them (NULL: all) start now, the others are claimed
    -- ahead. limited: the message carries a concurrency key; unconfirmed: its last delivery was
    -- claimed ahead and never started; lease_end: its lease's end as the statement's snapshot
    -- read it, or NULL when its key, held by jobs of several types, holds more permits than the
    -- least of its holders' current limits: a limit lowered since this job took its permit (its
    -- own type's, or another holder's), so it is admitted again, or parks, before it starts
    -- (design §109: read in the claim's snapshot, so a definition committed before the claim is
    -- always seen, and one committed after it finds the job started). A key held by one type
    -- costs one probe of its row; its own lowered limit is met by its key version.
    -- The priorities are the claim index's ranks (lockgate._rank_sql): -1 first, where a message
    -- whose priority header is not 0..9 waits to be dead-lettered by the claim (H29; none of
    -- lockgate's own messages is ever there, so the probe finds it empty), then 0 to 9.
    -- The priority probe is a LATERAL subquery with its own LIMIT: the planner cannot turn it
    -- into a semi-join over the whole table, as it may an EXISTS when most messages are
    -- visible. Ordered as the claim index is, so it is always that index's probe: unordered,
    -- with statistics saying most messages are visible at that priority (taken during a burst
    -- that is now in flight), a sequential scan looked as cheap for LIMIT 1 and read the whole
    -- queue once per priority.
    -- Hash and merge joins off: the plan kept for the session may be the generic one, which
    -- knows no qty; guessing a large one, it joined the taken rows back to the table through a
    -- sequential scan of the whole queue, and kept doing so for every later claim. Joined by
    -- primary key lookups, a claim reads what it takes.
    -- Sequential scans off: a plan made while the queue fitted in a page or two (a few claims
    -- on a small queue just analysed) read it sequentially, cheapest then, in the probe, the
    -- take and the join back, and every later claim of that session read the whole queue once
    -- producers filled it, until its next ANALYZE. With them off, every plan goes by the claim
    -- index and the primary key, whatever the statistics said when it was made.
    -- read_ct stops one short of the integer's end and stays there: only a row written by hand
    -- gets that far, and its delivery, past any max_attempts, is dead-lettered by the worker,
    -- where an overflow failed the claim of the whole queue.
    body := format($f$
        #variable_conflict use_column
        DECLARE
            best integer := -2;
            wanted integer := $1;
            took integer;
        BEGIN
            WHILE wanted > 0 LOOP
                best := (SELECT g.p FROM generate_series(best + 1, 9) g(p)
                          CROSS JOIN LATERAL (SELECT 1 FROM %1$s m
                                               WHERE %2$s = g.p AND m.vt <= $4
                                               ORDER BY %2$s, m.vt
                                               LIMIT 1) visible
                          LIMIT 1);
                EXIT WHEN best IS NULL;
                RETURN QUERY
                WITH next AS (
                     SELECT m.msg_id, m.vt AS was, jsonb_typeof(m.headers) = 'object' AND m.headers ? 'ckey' AS limited,
                            m.read_ct > 0 AND m.last_read_at IS NULL AS unconfirmed
                       FROM %1$s m
                      WHERE %2$s = best AND m.vt <= $4
                      ORDER BY %2$s, m.vt, m.msg_id
                      LIMIT wanted
                        FOR UPDATE SKIP LOCKED),
                 ranked AS (SELECT next.*, row_number() OVER (ORDER BY next.was, next.msg_id) AS rn FROM next)
                 UPDATE %1$s m
                    SET vt = clock_timestamp() + make_interval(secs => $2),
                        read_ct = LEAST(m.read_ct, 2147483646) + 1,
                        last_read_at = CASE WHEN ranked.rn > $5 - ($1 - wanted) THEN NULL ELSE clock_timestamp() END,
                        headers = CASE WHEN jsonb_typeof(m.headers) <> 'object' THEN m.headers
                                       WHEN $3 IS NULL THEN m.headers - 'retry_at'
                                       ELSE m.headers - 'retry_at' || jsonb_build_object('owner', $3) END
                   FROM ranked
                  WHERE m.msg_id = ranked.msg_id
                 RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.message, m.headers, m.vt, m.last_read_at IS NULL,
                           ranked.limited, ranked.unconfirmed,
                           CASE WHEN ranked.limited THEN (
                               SELECT CASE WHEN s.value > 1 AND s.sole_type IS DISTINCT FROM l.job_type
                                                AND s.value > (lockgate._holders(l.key, s.value)).lim THEN NULL
                                           ELSE l.expires_at END
                                 FROM lockgate.leases l LEFT JOIN lockgate.semaphores s ON s.key = l.key
                                WHERE l.queue = $6 AND l.msg_id = m.msg_id) END;
                GET DIAGNOSTICS took = ROW_COUNT;
                wanted := wanted - took;
            END LOOP;
        END $f$, tbl, lockgate._rank_sql('m.headers'));
    PERFORM lockgate._write_step(queue, '_claim_take_'::text,
        'TABLE (msg_id bigint, read_ct integer, enqueued_at timestamptz, message jsonb, headers jsonb, vt timestamptz,
                ahead boolean, limited boolean, unconfirmed boolean, lease_end timestamptz)'::text,
        '{enable_hashjoin=off,enable_mergejoin=off,enable_seqscan=off,jit=off}'::text[], body,
        ARRAY['_claim_probe_' || queue]::text[]);
END $$;

-- Claim: take up to qty visible messages of a queue, lowest priority value first, then the one
-- visible longest (its scheduled time, or its retry time), then the oldest, making them
-- invisible for vt_seconds and incrementing read_ct. Each returned row is one delivery;
-- (queue, msg_id, read_ct) is its fencing token for every later step, and budget_seconds is how
-- long its visibility holds, counted from the start of the claim.
--
-- Nothing runs without its permit (G3, H24): a claimed job of a limited type is returned only
-- holding a live lease whose end is at or after its new visibility's (vt <= expires_at), so the
-- holder's budget ends no later than its permit: a lease that already outlasts the visibility is
-- only read (nothing but this delivery's own fenced steps can remove it before its end), one that
-- does not is renewed and locked by this claim, and the visibility is cut to it if still shorter.
-- A claimed limited job whose lease lapsed (or was expired by a sweep) takes a permit again
-- through the guarded acquire, or is parked, and is then not returned. A message no worker could
-- run (headers or arguments that are not lockgate's, H29) is dead-lettered here with its reason:
-- no message content can make a claim fail. One whose priority header is not 0..9 sits at the
-- claim index's rank -1, ahead of every job, so the next claim of its queue takes it, however
-- busy the queue; a JSON string of one digit ("5") reads as that digit's rank (the index reads
-- the header as text), and is dead-lettered when that priority's turn comes.
--
-- A job delivered again whose earlier delivery's `sql` statement still runs, on a backend that
-- carries the job's mark (sql/046_statements.sql), has that backend ended first, or is put back
-- for a second when it cannot be (docs/design.md §100).
--
-- One priority at a time, through the claim index (priority, vt, msg_id): within a priority the
-- visible messages come first, so a claim never scans the delayed or in-flight ones after them.
-- The queue's claim step (above) finds the next priority holding a visible message (one index
-- probe per priority, stopping at the first) and claims from it, until it has qty or no
-- priority is left; its statements are planned once per session, and the claim calls it once.
--
-- Locks, in the order every path keeps (docs/design.md, "Lock order"): the claimed message rows
-- (FOR UPDATE SKIP LOCKED: concurrent claimers never wait or collide), then their lease rows
-- (renewed in the same statement; a sweep may hold one for the instant it takes to delete it),
-- then, only for jobs whose lease is gone, semaphore rows in key order, never waiting for one:
-- a key held by an open producer transaction puts its job back for a moment instead (H28).
-- Each claimed message records its owner (the claiming process's supervisor id, or NULL), and
-- loses its retry_at mark (it is running, not waiting). A job of a while_executing type takes
-- its unique key last (lockgate._start_unique), or is put back, or is delivered with
-- duplicate_of in its headers: its worker completes it without running it.
--
-- Attempts count runs that started (H32). last_read_at is when the current delivery started
-- running. A worker that claims more than it starts at once (its claim-ahead) says how many start
-- at once (start_now, in claim order; NULL: all of them): the others are returned with
-- claimed_ahead true and last_read_at NULL, and the worker records each one's start
-- (lockgate.complete's started arguments set last_read_at; not an indexed column, so a HOT update).
-- A claim that finds a delivered message (read_ct > 0) whose last_read_at is still NULL — its
-- worker died before starting it — counts that delivery as a return, not an attempt; at most 3
-- times per job (header unstarted), so a job that kills its worker the instant it starts, before
-- its start is recorded, still runs out of attempts.
-- A paused queue (lockgate.pause_queue) returns nothing, nor one whose table was made again
-- outside lockgate until lockgate adopts it (lockgate._made_again). A claim that took messages it does not
-- return (dead-lettered, parked, put back) notifies the queue's channel, so a worker that reads a
-- short claim as an empty queue claims again (docs/design.md section 51).
-- Callers: the worker's fetch loop. qty = batch size, vt_seconds = visibility timeout.
CREATE OR REPLACE FUNCTION lockgate.claim(queue text, qty integer, vt_seconds double precision, owner bigint DEFAULT NULL,
                                          start_now integer DEFAULT NULL)
RETURNS TABLE (msg_id bigint, read_ct integer, enqueued_at timestamptz, message jsonb, headers jsonb,
               budget_seconds double precision, claimed_ahead boolean)
LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    -- The queue's table, named once the claim has found the queue's row (as _queue_table would).
    tbl text;
    -- The queue's claim step (lockgate._install_claim_steps), called through a statement that is
    -- cheap to plan: the step's own statements are planned once per session. Named once the
    -- queue is known to exist (a NULL name would fail in format() with an error naming nothing).
    take text;
    r record;
    left_to_claim integer := qty;
    -- Bound as a value, not called in the statements: clock_timestamp() is volatile, so a
    -- condition on it could not bound the index scan. Budgets are counted from here.
    at timestamptz := clock_timestamp();
    problem text;
    -- The limited types and their key derivations' versions, read once per claim, at the first
    -- message taken: a claim that finds nothing never needs them.
    keyed_types text[];
    key_versions integer[];
    types_read boolean := false;
    i integer;
    -- Limited jobs, whose leases are renewed after the claim statements; those whose lease is
    -- gone or of another key, decided after that, in key order.
    limited lockgate._claimed[] := '{}';
    lease_end timestamptz;
    -- Read only when a lease is renewed: a SQL function with a subquery is not inlined, and is
    -- planned again in every transaction that calls it.
    floor_ms bigint;
    unleased lockgate._claimed[] := '{}';
    u lockgate._claimed;
    visible_at timestamptz;
    -- Deliveries returned; fewer than were taken when some were dead-lettered, parked or put back.
    returned integer := 0;
    paused timestamptz;
    -- The marks of backends running jobs' statements, read at the first job delivered again.
    marks text[];
    mark text;
    fence_until timestamptz;
BEGIN
    -- One primary-key lookup says the queue exists and whether it is paused.
    SELECT q.paused_at INTO paused FROM lockgate.queues q WHERE q.name = claim.queue;
    IF NOT FOUND THEN
        PERFORM lockgate._queue_table(queue, 'q');  -- raises LG001 for the unknown queue
    END IF;
    tbl := format('pgmq.%I', 'q_' || queue);
    take := format('SELECT * FROM lockgate.%I($1, $2, $3, $4, $5, $6)', '_claim_take_' || queue);
    IF vt_seconds IS NULL OR NOT vt_seconds > 0 OR vt_seconds IN ('infinity', 'NaN') THEN
        RAISE EXCEPTION 'lockgate: invalid visibility timeout % seconds: a positive, finite number', vt_seconds
            USING ERRCODE = 'LG003';
    END IF;
    -- A paused queue gives nothing (lockgate.pause_queue), nor one whose table was made again
    -- outside lockgate (pgmq.drop_queue, pgmq.create) until lockgate adopts it: what it holds
    -- was sent with PGMQ's own ids, which may be the msg_ids of the dropped table's deliveries,
    -- still held by their workers as fencing tokens and by leases (docs/design.md §71).
    IF paused IS NOT NULL OR lockgate._made_again(queue) THEN
        RETURN;
    END IF;
    -- A step that is not lockgate's (dropped by hand, or the queue's table was missing at the
    -- last migrate; planted by another role: lockgate._trusted_step, by signature) is written
    -- again here, under create_queue's lock, before the claim runs it; an installer that may
    -- not replace another role's function fails the claim, naming it, rather than run it. An
    -- overload beside the step is left to the next install (one with an extra defaulted
    -- argument makes the claim's call ambiguous until then, as before).
    IF NOT lockgate._trusted_step('_claim_take_', queue, true) THEN
        PERFORM lockgate._install_claim_steps(queue);
    END IF;
    FOR r IN EXECUTE take USING qty, vt_seconds, owner, at, start_now, queue
    LOOP
        left_to_claim := left_to_claim - 1;
        -- Looked at again once the take holds the table: the look above ran before the take
        -- waited for it, and a transaction that dropped and made the table again may have
        -- committed in between (review of §71). Nothing taken from it is kept.
        IF left_to_claim = qty - 1 AND lockgate._made_again(queue) THEN
            RAISE EXCEPTION 'lockgate: queue "%" has a table made again outside lockgate (pgmq.create): run lockgate migrate to adopt it', queue
                USING ERRCODE = '55000';
        END IF;
        -- A job delivered again: an earlier delivery's `sql` statement may still run on the server,
        -- its lockgate frozen or cut off. Its backend is ended first, or, if it cannot be, the job
        -- is put back until it has (docs/design.md §100). The marks are read once per claim, after
        -- the take locked every row it returns (sql/046_statements.sql).
        IF r.read_ct > 1 THEN
            IF marks IS NULL THEN
                marks := lockgate._statement_marks();
            END IF;
            IF cardinality(marks) > 0 THEN
                mark := lockgate._statement_tag(queue, r.msg_id);
                -- One deadline for the whole claim, however many of its jobs wait for theirs.
                fence_until := COALESCE(fence_until, clock_timestamp() + interval '200 milliseconds');
                IF mark = ANY (marks) AND cardinality(lockgate._end_statements(ARRAY[mark], fence_until)) > 0 THEN
                    PERFORM lockgate._put_back(tbl,
                        ROW(r.msg_id, r.read_ct, r.enqueued_at, r.message, r.headers, r.vt, r.ahead)::lockgate._claimed);
                    CONTINUE;
                END IF;
            END IF;
        END IF;
        -- Checked here, row by row, not in the take step: written when that statement was
        -- planned at every call, where planning the inlined check cost more than the claim's
        -- own work; whether the check now costs less inside the step is not measured.
        problem := lockgate._malformed(r.message, r.headers);
        IF problem IS NOT NULL THEN
            PERFORM lockgate.dead_letter(queue, r.msg_id, r.read_ct, 'undecodable', problem, r.read_ct);
            CONTINUE;
        END IF;
        IF r.unconfirmed AND COALESCE((r.headers->>'unstarted')::integer, 0) < 3 THEN
            -- The last delivery was claimed ahead and its start never recorded: its worker died
            -- before running it, so it was a return, not an attempt (H32).
            r.headers := r.headers || jsonb_build_object(
                'returns', LEAST(COALESCE((r.headers->>'returns')::integer, 0) + 1, 999999999),
                'unstarted', COALESCE((r.headers->>'unstarted')::integer, 0) + 1);
            EXECUTE format('UPDATE %s m SET headers = $2 WHERE m.msg_id = $1', tbl) USING r.msg_id, r.headers;
        END IF;
        -- A job whose type gained a limit, whose key was derived under other key paths, or
        -- whose permit was taken under a higher limit (its own type's, or one sharing its key),
        -- takes a permit of the key the current policy gives it (H33), giving back the one it
        -- holds; a key given explicitly at enqueue stays its key, and is taken again under the
        -- current limit (design §80, §109). One whose type lost its limit gives its permit back.
        IF NOT types_read THEN
            SELECT array_agg(t.name), array_agg(t.concurrency_key_version) INTO keyed_types, key_versions
              FROM lockgate.job_types t WHERE t.concurrency_limit IS NOT NULL;
            types_read := true;
        END IF;
        i := array_position(keyed_types, r.headers->>'type');
        IF (i IS NOT NULL AND (NOT r.limited OR COALESCE((r.headers->>'kv')::integer, 0) <> key_versions[i]))
           -- A job of a type no longer limited (or gone) still carrying its key gives its permit
           -- back and runs without it (or is dead-lettered).
           OR (i IS NULL AND r.limited) THEN
            unleased := unleased || ROW(r.msg_id, r.read_ct, r.enqueued_at, r.message, r.headers, r.vt, r.ahead)::lockgate._claimed;
            CONTINUE;
        END IF;
        -- A lease that outlasts the new visibility needs nothing more: until its end only this
        -- delivery's own fenced steps can remove it (a sweep frees only leases past their end,
        -- and every other step on it needs the message row this claim holds). Read from the
        -- statement's snapshot, the end may be older than the row: a release or retry of the
        -- last delivery can commit between the snapshot and the message's lock; but no step
        -- ever moves a lease's end earlier (each renews it to GREATEST(old, new)), so the end
        -- read is a lower bound of the end that holds. (A lease marked finished is brought
        -- forward to now, sql/015_concurrency.sql, but only in the transaction that removed its
        -- message: no claim finds that message again.)
        IF r.limited AND r.lease_end IS NULL THEN
            unleased := unleased || ROW(r.msg_id, r.read_ct, r.enqueued_at, r.message, r.headers, r.vt, r.ahead)::lockgate._claimed;
            CONTINUE;
        END IF;
        IF r.limited AND r.lease_end < r.vt THEN
            limited := limited || ROW(r.msg_id, r.read_ct, r.enqueued_at, r.message, r.headers, r.vt, r.ahead)::lockgate._claimed;
            CONTINUE;
        END IF;
        IF r.headers ? 'wkey' THEN
            r.headers := lockgate._start_unique(queue,
                ROW(r.msg_id, r.read_ct, r.enqueued_at, r.message, r.headers, r.vt, r.ahead)::lockgate._claimed);
            CONTINUE WHEN r.headers IS NULL;
        END IF;
        msg_id := r.msg_id;
        read_ct := r.read_ct;
        enqueued_at := r.enqueued_at;
        message := r.message;
        headers := r.headers;
        budget_seconds := extract(epoch FROM r.vt - at);
        claimed_ahead := r.ahead;
        returned := returned + 1;
        RETURN NEXT;
    END LOOP;
    -- The leases that end before the new visibility would (a backlog older than the limit's
    -- duration, or a duration shorter than the visibility), renewed (and so locked) before the
    -- claim commits; this claim holds their messages, so only a sweep expiring a lease could race
    -- it, and the renewal waits for that sweep and then finds the lease gone. A lease already past
    -- its end is not renewed: its permit may have been given to another job; the job takes one
    -- again or parks (lockgate._reacquire). One primary-key lookup per job, a plan that holds
    -- without statistics; jobs whose lease outlasts their visibility never pay for it.
    IF cardinality(limited) > 0 THEN
        floor_ms := lockgate._lease_floor_ms();
        FOR u IN SELECT * FROM unnest(limited) LOOP
            UPDATE lockgate.leases l
               SET expires_at = GREATEST(l.expires_at, clock_timestamp() + lockgate._lease_interval(l.duration_ms, floor_ms))
             WHERE l.queue = claim.queue AND l.msg_id = u.msg_id AND l.expires_at > clock_timestamp()
            RETURNING l.expires_at INTO lease_end;
            IF NOT FOUND THEN
                unleased := unleased || u;
                CONTINUE;
            END IF;
            IF lease_end < u.vt THEN
                -- The visibility never outlives the lease (a duration shorter than the visibility).
                EXECUTE format('UPDATE %s m SET vt = $2 WHERE m.msg_id = $1', tbl) USING u.msg_id, lease_end;
                u.vt := lease_end;
            END IF;
            IF u.headers ? 'wkey' THEN
                u.headers := lockgate._start_unique(queue, u);
                CONTINUE WHEN u.headers IS NULL;
            END IF;
            msg_id := u.msg_id;
            read_ct := u.read_ct;
            enqueued_at := u.enqueued_at;
            message := u.message;
            headers := u.headers;
            budget_seconds := extract(epoch FROM u.vt - at);
            claimed_ahead := u.ahead;
            returned := returned + 1;
            RETURN NEXT;
        END LOOP;
    END IF;
    IF cardinality(unleased) > 0 THEN
        -- Semaphore rows are taken in key order, the order every path keeps (H31).
        FOR u IN SELECT * FROM unnest(unleased) x ORDER BY x.headers->>'ckey' NULLS FIRST, x.msg_id LOOP
            visible_at := lockgate._reacquire(queue, u);
            CONTINUE WHEN visible_at IS NULL;
            msg_id := u.msg_id;
            read_ct := u.read_ct;
            enqueued_at := u.enqueued_at;
            message := u.message;
            -- As _reacquire left them (it may have given the job its key).
            EXECUTE format('SELECT m.headers FROM %s m WHERE m.msg_id = $1', tbl) INTO headers USING u.msg_id;
            IF headers ? 'wkey' THEN
                u.headers := headers;
                headers := lockgate._start_unique(queue, u);
                CONTINUE WHEN headers IS NULL;
            END IF;
            -- The budget ends when the message becomes visible again, however long this took.
            budget_seconds := extract(epoch FROM visible_at - at);
            claimed_ahead := u.ahead;
            returned := returned + 1;
            RETURN NEXT;
        END LOOP;
    END IF;
    -- Taken but not returned (dead-lettered, parked, put back): a worker sees a claim that ran
    -- short and may leave the queue alone until a wake-up, while more visible messages wait behind
    -- the ones taken. Wake it (at this claim's commit); rows put back stay invisible for a second,
    -- so the next claim does not take them again at once.
    IF qty - left_to_claim > returned THEN
        PERFORM pg_notify('lockgate_' || queue, '');
    END IF;
END $$;

-- Why a claimed message cannot be a lockgate job, or NULL when it can: the checks the worker's
-- decoding makes, made in SQL so that the claim can dead-letter such a message instead of
-- failing on it (H29). Never raises, whatever JSON it is given. STABLE, as format() is: declared
-- IMMUTABLE it would not be inlined into the claim statement, and would cost a call per row.
CREATE OR REPLACE FUNCTION lockgate._malformed(message jsonb, headers jsonb)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN headers IS NULL OR jsonb_typeof(headers) <> 'object' THEN
            format('message headers are not a JSON object (got %s)', COALESCE(jsonb_typeof(headers), 'none'))
        WHEN jsonb_typeof(headers->'type') IS DISTINCT FROM 'string' THEN
            format('message headers carry no job type string at "type" (got %s)', COALESCE(jsonb_typeof(headers->'type'), 'nothing'))
        WHEN jsonb_typeof(headers->'job_id') NOT IN ('number', 'null')
          OR (jsonb_typeof(headers->'job_id') = 'number' AND headers->>'job_id' !~ '^[1-9][0-9]{0,17}$') THEN
            format('job_id %s in the headers is not a positive integer', headers->'job_id')
        WHEN headers ? 'ckey' AND (jsonb_typeof(headers->'ckey') IS DISTINCT FROM 'string'
                                   OR length(headers->>'ckey') NOT BETWEEN 1 AND 512) THEN
            format('concurrency key %s in the headers is not a string of 1 to 512 characters', left(headers->>'ckey', 100))
        WHEN headers ? 'ukey' AND (jsonb_typeof(headers->'ukey') IS DISTINCT FROM 'string'
                                   OR length(headers->>'ukey') NOT BETWEEN 1 AND 512) THEN
            format('unique key %s in the headers is not a string of 1 to 512 characters', left(headers->>'ukey', 100))
        WHEN headers ? 'wkey' AND (jsonb_typeof(headers->'wkey') IS DISTINCT FROM 'string'
                                   OR length(headers->>'wkey') NOT BETWEEN 1 AND 512) THEN
            format('unique key %s in the headers is not a string of 1 to 512 characters', left(headers->>'wkey', 100))
        WHEN jsonb_typeof(headers->'duplicate_of') NOT IN ('number', 'null')
          OR (jsonb_typeof(headers->'duplicate_of') = 'number' AND headers->>'duplicate_of' !~ '^[1-9][0-9]{0,17}$') THEN
            format('duplicate_of %s in the headers is not a job id', headers->'duplicate_of')
        WHEN jsonb_typeof(headers->'batch') NOT IN ('number', 'null')
          OR (jsonb_typeof(headers->'batch') = 'number' AND headers->>'batch' !~ '^[1-9][0-9]{0,17}$') THEN
            format('batch %s in the headers is not a batch id', headers->'batch')
        WHEN jsonb_typeof(headers->'priority') NOT IN ('number', 'null')
          OR (jsonb_typeof(headers->'priority') = 'number' AND headers->>'priority' !~ '^[0-9]$') THEN
            format('priority %s in the headers is not an integer from 0 to 9', headers->'priority')
        WHEN jsonb_typeof(headers->'returns') NOT IN ('number', 'null')
          OR (jsonb_typeof(headers->'returns') = 'number' AND headers->>'returns' !~ '^[0-9]{1,9}$') THEN
            format('returns %s in the headers is not a count', headers->'returns')
        WHEN jsonb_typeof(headers->'shutdown_returns') NOT IN ('number', 'null')
          OR (jsonb_typeof(headers->'shutdown_returns') = 'number' AND headers->>'shutdown_returns' !~ '^[0-9]{1,9}$') THEN
            format('shutdown_returns %s in the headers is not a count', headers->'shutdown_returns')
        WHEN jsonb_typeof(headers->'unstarted') NOT IN ('number', 'null')
          OR (jsonb_typeof(headers->'unstarted') = 'number' AND headers->>'unstarted' !~ '^[0-9]{1,9}$') THEN
            format('unstarted %s in the headers is not a count', headers->'unstarted')
        WHEN jsonb_typeof(headers->'kv') NOT IN ('number', 'null')
          OR (jsonb_typeof(headers->'kv') = 'number' AND headers->>'kv' !~ '^[0-9]{1,9}$') THEN
            format('kv %s in the headers is not a count', headers->'kv')
        WHEN jsonb_typeof(headers->'attempts_before') NOT IN ('number', 'null')
          OR (jsonb_typeof(headers->'attempts_before') = 'number' AND headers->>'attempts_before' !~ '^[0-9]{1,9}$') THEN
            format('attempts_before %s in the headers is not a count', headers->'attempts_before')
        WHEN message IS NULL OR jsonb_typeof(message) <> 'object' THEN
            format('job arguments are not a JSON object (got %s)', COALESCE(jsonb_typeof(message), 'none'))
    END
$$;

-- At claim, for a limited job whose lease is gone (it lapsed while the job waited or while its
-- holder was silent, and a sweep may have given its permit to another job), or whose permit must
-- be of another key (its type gained a limit or changed its key paths since it was enqueued,
-- H33): give back any lease it still holds, then take a permit of the key its type's current
-- policy gives it through the guarded acquire and return the new lease's end; or park the job
-- (that key is full), put it back for a moment (a key's row is held by another transaction,
-- H28), or dead-letter it (its type is gone, H16; its key is too long), and return NULL: then it
-- is not run. Returns when the message becomes visible again (the end of the delivery's budget,
-- never after its lease). Never runs without a permit (G3). A permit it gave back that it did not
-- take again (it parked, or its permit is of another key now) goes to the old key's parked jobs
-- at once, as a completion's would (H6): on a key types share, a job of a looser type may have
-- room where this one had none (design §109).
-- Locks: semaphore rows, never waiting for one (so the order between the old and the new key
-- cannot deadlock); the lease bound to the message; when it promotes, the parked rows (SKIP
-- LOCKED) and the uniqueness locks of the jobs promoted, as a completion does. The message row is
-- already locked by the claim. Callers: lockgate.claim.
CREATE OR REPLACE FUNCTION lockgate._reacquire(queue text, c lockgate._claimed)
RETURNS timestamptz LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    jt lockgate.job_types;
    ckey text;
    held text;
    stale integer;
    -- A permit of held was given back here: its key's parked jobs are looked at once this job
    -- has its own (or has parked).
    gave_back boolean := false;
    job bigint := COALESCE((c.headers->>'job_id')::bigint, c.msg_id);
    tbl text := lockgate._queue_table(queue, 'q');
    lease_end timestamptz;
    visible_at timestamptz;
    -- The attempts of the job's earlier messages, and with this message's before this delivery.
    before integer;
    made integer;
BEGIN
    SELECT * INTO jt FROM lockgate.job_types t WHERE t.name = c.headers->>'type';
    IF NOT FOUND THEN
        PERFORM lockgate.dead_letter(queue, c.msg_id, c.read_ct, 'unknown_job_type',
            format('job type "%s" is not defined in lockgate.job_types', c.headers->>'type'), c.read_ct);
        RETURN NULL;
    END IF;
    -- A lease still bound to the message (past its end, or of its old key) gives its permit back.
    SELECT l.key INTO held FROM lockgate.leases l WHERE l.queue = _reacquire.queue AND l.msg_id = c.msg_id;
    IF held IS NOT NULL THEN
        IF lockgate._lock_key_now(held, NULL) THEN
            -- Only the rows deleted here are given back: a sweep may have expired the lease since
            -- it was read (G2).
            WITH gone AS (DELETE FROM lockgate.leases l WHERE l.queue = _reacquire.queue AND l.msg_id = c.msg_id RETURNING 1)
            SELECT count(*) INTO stale FROM gone;
            PERFORM lockgate._give_back(held, stale);
            gave_back := stale > 0;
        ELSIF EXISTS (SELECT 1 FROM lockgate.semaphores s WHERE s.key = held) THEN
            RETURN lockgate._put_back(tbl, c);
        ELSE
            -- Its key has no row (only a bug, or a hand edit past migration 19's guards, makes
            -- such a lease, docs/design.md §61): no row counts it, so it is deleted with nothing
            -- to give back.
            DELETE FROM lockgate.leases l WHERE l.queue = _reacquire.queue AND l.msg_id = c.msg_id;
        END IF;
    END IF;
    IF jt.concurrency_limit IS NULL THEN
        -- Its type's limit was removed: it runs unlimited, and its message drops the key so the
        -- heartbeat does not look for a lease. The permit it took under the limit went back
        -- above: a job that has not started holds none of a type without a limit, and on a key
        -- types share it would count against the other types' limits (design §109).
        EXECUTE format('UPDATE %s m SET headers = m.headers - ''ckey'' - ''ckey_explicit''
                         WHERE m.msg_id = $1 AND m.read_ct = $2 RETURNING m.vt', tbl)
           INTO visible_at USING c.msg_id, c.read_ct;
        IF gave_back THEN
            PERFORM lockgate._send_promotions(lockgate._promote_keys(ARRAY[held], ARRAY[0]));
        END IF;
        RETURN visible_at;
    END IF;
    ckey := CASE WHEN c.headers ? 'ckey_explicit' THEN c.headers->>'ckey'
                 ELSE lockgate._concurrency_key(jt, c.message, NULL) END;
    IF length(ckey) > 512 THEN
        IF gave_back THEN
            PERFORM lockgate._send_promotions(lockgate._promote_keys(ARRAY[held], ARRAY[0]));
        END IF;
        PERFORM lockgate.dead_letter(queue, c.msg_id, c.read_ct, 'undecodable',
            format('concurrency key derived from the arguments is %s characters, more than the 512 allowed', length(ckey)),
            c.read_ct);
        RETURN NULL;
    END IF;
    IF NOT lockgate._lock_key_now(ckey, jt.concurrency_limit) THEN
        -- Put back for its new key; the old key's permit given back goes to its parked jobs
        -- now (review helper-127 F3).
        IF gave_back AND held <> ckey THEN
            PERFORM lockgate._send_promotions(lockgate._promote_keys(ARRAY[held], ARRAY[0]));
        END IF;
        RETURN lockgate._put_back(tbl, c);
    END IF;
    IF c.headers->>'ckey' IS DISTINCT FROM ckey OR COALESCE((c.headers->>'kv')::integer, 0) <> jt.concurrency_key_version THEN
        c.headers := c.headers - 'kv' || jsonb_build_object('ckey', ckey)
            || CASE WHEN jt.concurrency_key_version = 0 THEN '{}' ELSE jsonb_build_object('kv', jt.concurrency_key_version) END;
        EXECUTE format('UPDATE %s m SET headers = $3 WHERE m.msg_id = $1 AND m.read_ct = $2', tbl)
          USING c.msg_id, c.read_ct, c.headers;
    END IF;
    IF lockgate._acquire(ckey, jt.concurrency_limit, jt.name) THEN
        INSERT INTO lockgate.leases (queue, msg_id, key, duration_ms, expires_at, job_type)
        VALUES (queue, c.msg_id, ckey, jt.concurrency_duration_ms,
                clock_timestamp() + lockgate._lease_interval(jt.concurrency_duration_ms), jt.name)
        RETURNING expires_at INTO lease_end;
        IF gave_back AND held <> ckey THEN
            PERFORM lockgate._send_promotions(lockgate._promote_keys(ARRAY[held], ARRAY[0]));
        END IF;
        -- The visibility never outlives the lease.
        EXECUTE format('UPDATE %s m SET vt = LEAST(m.vt, $3) WHERE m.msg_id = $1 AND m.read_ct = $2 RETURNING m.vt', tbl)
           INTO visible_at USING c.msg_id, c.read_ct, lease_end;
        RETURN visible_at;
    END IF;
    EXECUTE format('DELETE FROM %s m WHERE m.msg_id = $1 AND m.read_ct = $2', tbl) USING c.msg_id, c.read_ct;
    -- Promoted later as a new message (read_ct 0), the job keeps its id in the headers, and the
    -- attempts its earlier deliveries made in attempts_before (this one never ran, H32), with
    -- those that recorded no outcome written into its history as lost.
    before := lockgate._attempts_before(c.headers);
    made := before + GREATEST(c.read_ct - 1 - COALESCE((c.headers->>'returns')::integer, 0), 0);
    INSERT INTO lockgate.parked (key, queue, job_type, job_id, args, headers, priority, run_at)
    VALUES (ckey, queue, jt.name, job, c.message,
            lockgate._record_lost(c.headers, before, made) - 'returns' - 'retry_at' - 'owner'
                || jsonb_build_object('job_id', job, 'enqueued_at', COALESCE(c.headers->'enqueued_at', to_jsonb(c.enqueued_at)),
                                      'attempts_before', made),
            COALESCE((c.headers->>'priority')::smallint, 0), clock_timestamp());
    IF c.headers ? 'ukey' OR c.headers ? 'wkey' THEN
        PERFORM lockgate._move_unique(queue, ARRAY[job], ARRAY[NULL::bigint]);
    END IF;
    -- The permit given back above may have room for the key's next parked job where this one
    -- found none: a job of another type on a key types share, whose limit or holders' limits are
    -- looser (design §109), or the old key's, when the job moved to another. Promoted now, as a
    -- completion would, rather than at the next sweep (H6).
    IF gave_back THEN
        PERFORM lockgate._send_promotions(lockgate._promote_keys(ARRAY[held], ARRAY[0]));
    END IF;
    RETURN NULL;
END $$;

-- Locks a key's semaphore row if no other transaction holds it; true when locked. Never waits:
-- a key with no row yet is created (value 0, limit lim) under a lock_timeout of a few
-- milliseconds, so a row another transaction is inserting (an open producer transaction's
-- first enqueue of the key) makes it false instead of a wait. lim NULL: the key's row exists.
CREATE OR REPLACE FUNCTION lockgate._lock_key_now(key text, lim integer)
RETURNS boolean LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    saved text := current_setting('lock_timeout');
BEGIN
    PERFORM 1 FROM lockgate.semaphores s WHERE s.key = _lock_key_now.key FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        RETURN true;
    END IF;
    IF EXISTS (SELECT 1 FROM lockgate.semaphores s WHERE s.key = _lock_key_now.key) OR lim IS NULL THEN
        RETURN false;
    END IF;
    BEGIN
        PERFORM set_config('lock_timeout', '5ms', true);
        INSERT INTO lockgate.semaphores (key, lim, value) VALUES (_lock_key_now.key, _lock_key_now.lim, 0)
        ON CONFLICT ON CONSTRAINT semaphores_pkey DO NOTHING;
        PERFORM set_config('lock_timeout', saved, true);
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', saved, true);
        RETURN false;
    END;
    PERFORM 1 FROM lockgate.semaphores s WHERE s.key = _lock_key_now.key FOR UPDATE SKIP LOCKED;
    RETURN FOUND;
END $$;

-- Puts a claimed delivery back for a second without running it (a key it needs is held by
-- another transaction, such as an open producer transaction): the delivery counts as a return,
-- not an attempt (once: last_read_at is set, so the next claim does not count it again as a
-- delivery claimed ahead and never started). Returns NULL, for lockgate._reacquire to return.
-- The same time in put_back_until tells lockgate.jobs() that the delivery waits for its key, not
-- out a failed attempt's backoff (queued, not retrying; review helper-79).
CREATE OR REPLACE FUNCTION lockgate._put_back(tbl text, c lockgate._claimed)
RETURNS timestamptz LANGUAGE plpgsql AS $$
DECLARE
    until timestamptz := clock_timestamp() + interval '1 second';
BEGIN
    EXECUTE format(
        'UPDATE %s m SET vt = $3,
                         last_read_at = COALESCE(m.last_read_at, clock_timestamp()),
                         headers = m.headers || jsonb_build_object(''retry_at'', $3, ''put_back_until'', $3,
                                                                   ''returns'', LEAST(COALESCE((m.headers->>''returns'')::integer, 0) + 1, 999999999))
          WHERE m.msg_id = $1 AND m.read_ct = $2', tbl)
      USING c.msg_id, c.read_ct, until;
    RETURN NULL;
END $$;

-- A claimed job put back to wait for a unique key another job holds (lockgate._start_unique) gives
-- back the concurrency permit it holds while it waits, and its key's parked jobs that now have
-- room are promoted: the holder it waits for may be one of them (an until_executed job naming the
-- same concurrency key, parked behind this very permit: nothing of the key ran until the waiting
-- job's lease lapsed; review helper-132 F1, docs/design.md §114), and a job that does not run holds
-- no permit another job could run under. Its next claim takes a permit again or parks it
-- (lockgate._reacquire). Only when the key's row is free (SKIP LOCKED: never a wait, so no lock
-- order to keep) and in READ COMMITTED, as lockgate._promote_behind; otherwise the job keeps its
-- permit until a later claim of it gives it back, or its lease lapses.
-- Locks: the key's semaphore row, the lease bound to the message (its message row is held by the
-- claim), and what a promotion locks (parked rows SKIP LOCKED, the promoted jobs' unique locks).
CREATE OR REPLACE FUNCTION lockgate._yield_permit(queue text, msg_id bigint)
RETURNS void LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $$
DECLARE
    held text;
    n integer;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN;
    END IF;
    SELECT l.key INTO held FROM lockgate.leases l WHERE l.queue = _yield_permit.queue AND l.msg_id = _yield_permit.msg_id;
    IF held IS NULL OR NOT lockgate._lock_key_now(held, NULL) THEN
        RETURN;
    END IF;
    -- Only the rows deleted here are given back: a sweep may have expired the lease since it was
    -- read (G2).
    WITH gone AS (DELETE FROM lockgate.leases l WHERE l.queue = _yield_permit.queue AND l.msg_id = _yield_permit.msg_id
                  RETURNING 1)
    SELECT count(*) INTO n FROM gone;
    IF n > 0 THEN
        PERFORM lockgate._send_promotions(lockgate._promote_keys(ARRAY[held], ARRAY[n]));
    END IF;
END $$;

-- Claims from several queues in one statement (issue 14): lockgate.claim on each of queues in
-- order, each for what the earlier ones left of qty (and of start_now), until qty are claimed.
-- A pool serving many queues claims in one round trip and one commit instead of one per queue.
-- Each row names its queue. Any error fails the whole call; the worker then claims queue by
-- queue, so that one failing queue waits alone (H29). Locks: as lockgate.claim, queue by queue.
-- Callers: the worker's fetch loop, for a pool of more than one queue.
CREATE OR REPLACE FUNCTION lockgate.claim_queues(queues text[], qty integer, vt_seconds double precision,
                                                 owner bigint DEFAULT NULL, start_now integer DEFAULT NULL)
RETURNS TABLE (queue text, msg_id bigint, read_ct integer, enqueued_at timestamptz, message jsonb, headers jsonb,
               budget_seconds double precision, claimed_ahead boolean)
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    got integer := 0;
    n integer;
BEGIN
    FOREACH q IN ARRAY COALESCE(queues, '{}') LOOP
        EXIT WHEN got >= qty;
        -- NULL (every delivery starts) stays NULL: GREATEST ignores a NULL, and made it 0, every
        -- delivery claimed ahead (review helper-138 F4).
        RETURN QUERY SELECT q, c.* FROM lockgate.claim(q, qty - got, vt_seconds, owner,
                                                       CASE WHEN start_now IS NOT NULL THEN GREATEST(start_now - got, 0) END) c;
        GET DIAGNOSTICS n = ROW_COUNT;
        got := got + n;
    END LOOP;
END $$;

-- Every queue's claim index as create_queue builds it now (lockgate._install_claim_indexes), and
-- its claim step, written again with each install of these functions (a queue whose table was
-- dropped behind lockgate's back has neither: it cannot be claimed from).
SELECT lockgate._install_claim_indexes();
SELECT lockgate._install_claim_steps(q) FROM lockgate._live_queues() q;
