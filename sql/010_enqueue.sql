-- Enqueue: one job (lockgate.enqueue) or many jobs of one type (lockgate.enqueue_many), in the
-- caller's transaction (G8): the job exists if and only if that transaction commits.
-- Arguments are a JSON object (the PGMQ message); lockgate's fields go in the PGMQ headers.
-- options: {"delay": seconds >= 0} or {"run_at": timestamptz}, {"priority": 0..9}, {"queue": name}.
-- Locks: inserts into pgmq.q_<queue>. Callers: the Rust Client, the CLI, SQL producers, triggers.

-- Refuses anything that is not a JSON object of at most 1 MiB (MAX_PAYLOAD_BYTES in Rust).
CREATE OR REPLACE FUNCTION lockgate._check_args(args jsonb, ordinal integer DEFAULT NULL)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    which text := CASE WHEN ordinal IS NULL THEN '' ELSE ' #' || ordinal END;
BEGIN
    IF args IS NULL OR jsonb_typeof(args) <> 'object' THEN
        RAISE EXCEPTION 'lockgate: job arguments% must be a JSON object, got %', which, COALESCE(jsonb_typeof(args), 'null')
            USING ERRCODE = 'LG003';
    END IF;
    IF pg_column_size(args) > 1048576 THEN
        RAISE EXCEPTION 'lockgate: job arguments% are % bytes, more than the 1048576 allowed', which, pg_column_size(args)
            USING ERRCODE = 'LG003';
    END IF;
END $$;

-- Resolves the options object against the job type's policy: target queue, priority, visible-at.
CREATE OR REPLACE FUNCTION lockgate._resolve_options(
    jt lockgate.job_types, options jsonb,
    OUT queue text, OUT priority smallint, OUT vt timestamptz, OUT immediate boolean
) LANGUAGE plpgsql STABLE AS $$
DECLARE
    unknown text;
    delay_s double precision;
BEGIN
    options := COALESCE(options, '{}');
    IF jsonb_typeof(options) <> 'object' THEN
        RAISE EXCEPTION 'lockgate: enqueue options must be a JSON object' USING ERRCODE = 'LG003';
    END IF;
    SELECT string_agg(k, ', ') INTO unknown FROM jsonb_object_keys(options) k
     WHERE k NOT IN ('delay', 'run_at', 'priority', 'queue');
    IF unknown IS NOT NULL THEN
        RAISE EXCEPTION 'lockgate: unknown enqueue option(s): %', unknown
            USING ERRCODE = 'LG003', DETAIL = 'allowed: delay, run_at, priority, queue';
    END IF;
    IF options ? 'delay' AND options ? 'run_at' THEN
        RAISE EXCEPTION 'lockgate: give delay or run_at, not both' USING ERRCODE = 'LG003';
    END IF;
    vt := clock_timestamp();
    immediate := true;
    IF options ? 'delay' THEN
        IF jsonb_typeof(options->'delay') <> 'number' OR (options->>'delay')::double precision < 0 THEN
            RAISE EXCEPTION 'lockgate: invalid delay %: a number of seconds, 0 or more', options->'delay'
                USING ERRCODE = 'LG003';
        END IF;
        delay_s := (options->>'delay')::double precision;
        vt := vt + make_interval(secs => delay_s);
        immediate := delay_s = 0;
    ELSIF options ? 'run_at' THEN
        IF jsonb_typeof(options->'run_at') <> 'string'
           OR (options->>'run_at') !~ '^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}(:?\d{2})?)?$' THEN
            RAISE EXCEPTION 'lockgate: invalid run_at %: an ISO 8601 timestamp', options->'run_at'
                USING ERRCODE = 'LG003';
        END IF;
        vt := GREATEST((options->>'run_at')::timestamptz, vt);
        immediate := vt <= clock_timestamp();
    END IF;
    priority := jt.priority;
    IF options ? 'priority' THEN
        IF jsonb_typeof(options->'priority') <> 'number' OR (options->>'priority') !~ '^[0-9]$' THEN
            RAISE EXCEPTION 'lockgate: invalid priority %: an integer from 0 to 9', options->'priority'
                USING ERRCODE = 'LG003';
        END IF;
        priority := (options->>'priority')::smallint;
    END IF;
    queue := COALESCE(options->>'queue', jt.queue);
END $$;

CREATE OR REPLACE FUNCTION lockgate.enqueue(job_type text, args jsonb DEFAULT '{}', options jsonb DEFAULT '{}')
RETURNS TABLE (queue text, msg_id bigint, job_id bigint) LANGUAGE plpgsql AS $$
DECLARE
    jt lockgate.job_types := lockgate.job_policy(job_type);
    o record;
    new_job_id bigint;
    new_msg_id bigint;
BEGIN
    PERFORM lockgate._check_args(args);
    o := lockgate._resolve_options(jt, options);
    new_job_id := nextval('lockgate.job_id_seq');
    EXECUTE format('INSERT INTO %s (vt, message, headers) VALUES ($1, $2, $3) RETURNING msg_id',
                   lockgate._queue_table(o.queue, 'q'))
       INTO new_msg_id
      USING o.vt, args, jsonb_build_object('job_id', new_job_id, 'type', jt.name, 'priority', o.priority);
    IF o.immediate THEN
        PERFORM pg_notify('lockgate_' || o.queue, '');
    END IF;
    RETURN QUERY SELECT o.queue, new_msg_id, new_job_id;
END $$;

-- Many jobs of one type sharing one options object, in one statement; rows come back in the
-- order of args.
CREATE OR REPLACE FUNCTION lockgate.enqueue_many(job_type text, args jsonb[], options jsonb DEFAULT '{}')
RETURNS TABLE (queue text, msg_id bigint, job_id bigint) LANGUAGE plpgsql AS $$
DECLARE
    jt lockgate.job_types := lockgate.job_policy(job_type);
    o record;
    bad record;
BEGIN
    SELECT a.v, a.i INTO bad FROM unnest(args) WITH ORDINALITY a(v, i)
     WHERE a.v IS NULL OR jsonb_typeof(a.v) <> 'object' OR pg_column_size(a.v) > 1048576
     LIMIT 1;
    IF FOUND THEN
        PERFORM lockgate._check_args(bad.v, bad.i::integer);
    END IF;
    o := lockgate._resolve_options(jt, options);
    RETURN QUERY EXECUTE format(
        'WITH ins AS (
             INSERT INTO %s (vt, message, headers)
             SELECT $1, a.v, jsonb_build_object(''job_id'', nextval(''lockgate.job_id_seq''), ''type'', $2::text, ''priority'', $3::smallint)
               FROM unnest($4::jsonb[]) WITH ORDINALITY a(v, i) ORDER BY a.i
             RETURNING msg_id, (headers->>''job_id'')::bigint AS job_id)
         SELECT $5::text, ins.msg_id, ins.job_id FROM ins ORDER BY ins.msg_id',
        lockgate._queue_table(o.queue, 'q'))
      USING o.vt, jt.name, o.priority, args, o.queue;
    IF o.immediate AND cardinality(args) > 0 THEN
        PERFORM pg_notify('lockgate_' || o.queue, '');
    END IF;
END $$;
