-- Batches (G2, H22): jobs enqueued into a batch carry its id in their headers ("batch"); the
-- batch row counts them. total grows in the enqueue transaction; succeeded in the completion
-- that archived a job, failed in the dead-letter that removed one (or the discard of a parked
-- one), each gated by its fenced statement, so a duplicate delivery or a retry counts once.
-- The transaction that counts a closed batch's last job finishes it and enqueues its callbacks:
-- counting and finishing update the batch row, whose row lock serialises them, so of two last
-- completions racing on two connections exactly one sees the count complete (H22).
-- Lock order: a batch row comes after every other row its transaction locks (messages, leases,
-- semaphores, unique locks); batches in id order.

-- Validates a callback job type: NULL (none) or a defined type.
CREATE OR REPLACE FUNCTION lockgate._check_callback(which text, job_type text)
RETURNS void LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF job_type IS NOT NULL AND NOT EXISTS (SELECT 1 FROM lockgate.job_types t WHERE t.name = job_type) THEN
        RAISE EXCEPTION 'lockgate: unknown job type "%" for the batch callback %', job_type, which
            USING ERRCODE = 'LG002', HINT = 'define it with lockgate.define_job_type or in lockgate.toml first';
    END IF;
END $$;

-- A new, open batch. Callbacks are job types: on_finish runs when every job is counted,
-- on_success when none failed, on_failure when some did; each gets the arguments
-- {"batch_id", "total", "succeeded", "failed", "properties"}.
-- Locks: none. Callers: Client::create_batch, the CLI, SQL producers.
CREATE OR REPLACE FUNCTION lockgate.create_batch(on_finish text DEFAULT NULL, on_success text DEFAULT NULL,
                                                 on_failure text DEFAULT NULL, properties jsonb DEFAULT '{}')
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    id bigint;
BEGIN
    PERFORM lockgate._check_callback('on_finish', on_finish);
    PERFORM lockgate._check_callback('on_success', on_success);
    PERFORM lockgate._check_callback('on_failure', on_failure);
    IF properties IS NULL OR jsonb_typeof(properties) <> 'object' THEN
        RAISE EXCEPTION 'lockgate: batch properties must be a JSON object, got %', COALESCE(jsonb_typeof(properties), 'null')
            USING ERRCODE = 'LG003';
    END IF;
    INSERT INTO lockgate.batches (on_finish, on_success, on_failure, properties)
    VALUES (create_batch.on_finish, create_batch.on_success, create_batch.on_failure, create_batch.properties)
    RETURNING batches.id INTO id;
    RETURN id;
END $$;

-- Counts n jobs enqueued into an open batch; raises naming the batch when it does not exist or
-- is closed (nothing of the enqueue is kept). n may be 0 (every job a duplicate): the batch is
-- still checked.
CREATE OR REPLACE FUNCTION lockgate._add_to_batch(batch bigint, n integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    st text;
BEGIN
    UPDATE lockgate.batches b SET total = b.total + n, updated_at = now()
     WHERE b.id = batch AND b.state = 'open'
    RETURNING b.state INTO st;
    IF NOT FOUND THEN
        SELECT b.state INTO st FROM lockgate.batches b WHERE b.id = batch;
        RAISE EXCEPTION 'lockgate: %', CASE WHEN st IS NULL THEN format('batch %s does not exist', batch)
                                            ELSE format('batch %s is %s: no job can be added to it', batch, st) END
            USING ERRCODE = 'LG003';
    END IF;
END $$;

-- Closes an open batch: no job can be added any more, and it finishes when its last job is
-- counted (at once if none is pending). Raises for an unknown batch or one already closed.
-- Returns its state after closing ('closed' or 'finished').
-- Locks: the batch row. Callers: Client::close_batch, the CLI, SQL producers.
CREATE OR REPLACE FUNCTION lockgate.close_batch(batch_id bigint)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    b lockgate.batches;
BEGIN
    UPDATE lockgate.batches x SET state = 'closed', closed_at = now(), updated_at = now()
     WHERE x.id = batch_id AND x.state = 'open'
    RETURNING x.* INTO b;
    IF NOT FOUND THEN
        SELECT * INTO b FROM lockgate.batches x WHERE x.id = batch_id;
        RAISE EXCEPTION 'lockgate: %', CASE WHEN b.id IS NULL THEN format('batch %s does not exist', batch_id)
                                            ELSE format('batch %s is already %s', batch_id, b.state) END
            USING ERRCODE = 'LG003';
    END IF;
    IF b.succeeded + b.failed = b.total THEN
        PERFORM lockgate._finish_batch(b.id);
        RETURN 'finished';
    END IF;
    RETURN 'closed';
END $$;

-- Counts finished jobs of batches (one element per job; as_failed tells how): in batch id order,
-- each batch row once. Batches whose count is now complete and closed are finished here.
-- Called inside the transaction whose fenced statement ended these jobs. Ids that name no
-- batch (removed by hand) are ignored.
CREATE OR REPLACE FUNCTION lockgate._count_batches(batch_ids bigint[], as_failed boolean)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    done bigint;
BEGIN
    FOR done IN
        WITH n AS (SELECT x.id, count(*) AS n FROM unnest(batch_ids) AS x(id) GROUP BY x.id),
        counted AS (
            UPDATE lockgate.batches b
               SET succeeded = b.succeeded + CASE WHEN as_failed THEN 0 ELSE n.n END,
                   failed = b.failed + CASE WHEN as_failed THEN n.n ELSE 0 END,
                   updated_at = now()
              FROM (SELECT n.id, n.n FROM n JOIN lockgate.batches y ON y.id = n.id ORDER BY n.id FOR UPDATE OF y) n
             WHERE b.id = n.id
            RETURNING b.id, b.state, b.total, b.succeeded, b.failed)
        SELECT c.id FROM counted c WHERE c.state = 'closed' AND c.succeeded + c.failed = c.total ORDER BY c.id
    LOOP
        PERFORM lockgate._finish_batch(done);
    END LOOP;
END $$;

-- The batch ids in headers, for the jobs that carry a well-formed one.
CREATE OR REPLACE FUNCTION lockgate._batch_of(headers jsonb)
RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(headers) = 'object' AND headers->>'batch' ~ '^[1-9][0-9]{0,17}$'
                THEN (headers->>'batch')::bigint END
$$;

-- Finishes a closed batch whose jobs are all counted (the caller holds its row lock): marks it
-- finished and enqueues its callbacks. A callback that cannot be enqueued (its type was
-- removed, its uniqueness rejects it) does not fail the completion that finished the batch: the
-- batch keeps callbacks_pending and the error, and the sweep (lockgate.batch_sweep) tries
-- again. Each callback is enqueued once: the state moves to finished in this transaction, and
-- the sweep enqueues only while callbacks_pending is set, clearing it in the same transaction.
CREATE OR REPLACE FUNCTION lockgate._finish_batch(batch_id bigint)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    b lockgate.batches;
BEGIN
    UPDATE lockgate.batches x SET state = 'finished', finished_at = now(), updated_at = now(), callbacks_pending = true
     WHERE x.id = batch_id AND x.state = 'closed'
    RETURNING x.* INTO b;
    IF FOUND THEN
        PERFORM lockgate._enqueue_callbacks(b);
    END IF;
END $$;

-- Enqueues a finished batch's callbacks and clears callbacks_pending, or records why it could
-- not (all of them or none: a subtransaction).
CREATE OR REPLACE FUNCTION lockgate._enqueue_callbacks(b lockgate.batches)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    args jsonb := jsonb_build_object('batch_id', b.id, 'total', b.total, 'succeeded', b.succeeded, 'failed', b.failed,
                                     'properties', b.properties);
BEGIN
    BEGIN
        IF b.on_finish IS NOT NULL THEN
            PERFORM lockgate.enqueue(b.on_finish, args);
        END IF;
        IF b.on_success IS NOT NULL AND b.failed = 0 THEN
            PERFORM lockgate.enqueue(b.on_success, args);
        END IF;
        IF b.on_failure IS NOT NULL AND b.failed > 0 THEN
            PERFORM lockgate.enqueue(b.on_failure, args);
        END IF;
        UPDATE lockgate.batches x SET callbacks_pending = false, callback_error = NULL WHERE x.id = b.id;
    EXCEPTION WHEN OTHERS THEN
        UPDATE lockgate.batches x SET callback_error = left(SQLERRM, 4000) WHERE x.id = b.id;
    END;
END $$;

-- The batch sweep (dispatcher): enqueues the callbacks of finished batches whose callbacks
-- could not be enqueued when they finished. Returns how many batches it completed.
-- Locks: batch rows (SKIP LOCKED). Callers: the maintenance service, operators.
CREATE OR REPLACE FUNCTION lockgate.batch_sweep(max_rows integer DEFAULT 100)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    b lockgate.batches;
    repaired integer := 0;
BEGIN
    FOR b IN SELECT * FROM lockgate.batches x WHERE x.callbacks_pending AND x.state = 'finished'
              ORDER BY x.id LIMIT max_rows FOR UPDATE SKIP LOCKED LOOP
        PERFORM lockgate._enqueue_callbacks(b);
        IF NOT (SELECT x.callbacks_pending FROM lockgate.batches x WHERE x.id = b.id) THEN
            repaired := repaired + 1;
        END IF;
    END LOOP;
    RETURN repaired;
END $$;

-- One batch's progress; no row for an unknown id.
-- Locks: none. Callers: lockgate batch show, Client::batch, SQL users.
CREATE OR REPLACE FUNCTION lockgate.batch(batch_id bigint)
RETURNS TABLE (id bigint, state text, total bigint, succeeded bigint, failed bigint, pending bigint,
               on_finish text, on_success text, on_failure text, properties jsonb, callbacks_pending boolean,
               callback_error text, created_at timestamptz, closed_at timestamptz, finished_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT b.id, b.state, b.total, b.succeeded, b.failed, b.total - b.succeeded - b.failed,
           b.on_finish, b.on_success, b.on_failure, b.properties, b.callbacks_pending, b.callback_error,
           b.created_at, b.closed_at, b.finished_at
      FROM lockgate.batches b WHERE b.id = batch_id
$$;

-- Batches not yet finished (or with callbacks pending), oldest first, for lockgate status.
CREATE OR REPLACE FUNCTION lockgate.unfinished_batches(max_rows integer DEFAULT 20)
RETURNS SETOF lockgate.batches LANGUAGE sql STABLE AS $$
    SELECT * FROM lockgate.batches b WHERE b.state <> 'finished' OR b.callbacks_pending ORDER BY b.id LIMIT max_rows
$$;
