-- The process registry. register_process inserts one row (a supervisor, or a service owned by
-- one); heartbeat_processes renews a process's rows and returns the ids that still exist (a
-- missing supervisor id means this process was pruned: it must stop, hand back, re-register);
-- prune_processes deletes supervisors silent past the alive threshold (their services go with
-- them, ON DELETE CASCADE) and makes visible at once those of their in-flight jobs that were not
-- renewed within the threshold either: a process whose registry heartbeat stalled while its job
-- heartbeats went on keeps its jobs (H26, seed 000), and re-registers when it finds its row gone.
-- Correctness never rests on this: a delivery made visible is fenced as any other.
-- Locks: process rows; prune also updates the pruned owners' silent message rows (SKIP LOCKED).
-- Callers: the runtime's registry service; lockgate status; operators.

CREATE OR REPLACE FUNCTION lockgate.register_process(
    kind text, name text, host text, pid integer, supervisor_id bigint DEFAULT NULL, metadata jsonb DEFAULT '{}'
) RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO lockgate.processes (kind, name, host, pid, supervisor_id, metadata)
    VALUES (register_process.kind, register_process.name, register_process.host, register_process.pid,
            register_process.supervisor_id, COALESCE(register_process.metadata, '{}'))
    RETURNING id
$$;

CREATE OR REPLACE FUNCTION lockgate.heartbeat_processes(process_ids bigint[], process_metadata jsonb[])
RETURNS SETOF bigint LANGUAGE sql AS $$
    UPDATE lockgate.processes p
       SET last_heartbeat_at = now(), metadata = COALESCE(m.meta, p.metadata)
      FROM unnest(process_ids, process_metadata) AS m(id, meta)
     WHERE p.id = m.id
    RETURNING p.id
$$;

CREATE OR REPLACE FUNCTION lockgate.deregister_process(process_id bigint)
RETURNS void LANGUAGE sql AS $$
    DELETE FROM lockgate.processes p WHERE p.id = deregister_process.process_id
$$;

-- Returns the ids of the supervisors it pruned and how many in-flight jobs it made visible.
CREATE OR REPLACE FUNCTION lockgate.prune_processes(alive_threshold_seconds double precision)
RETURNS TABLE (pruned_id bigint, released bigint) LANGUAGE plpgsql AS $$
DECLARE
    dead record;
    q record;
    n bigint;
BEGIN
    FOR dead IN
        DELETE FROM lockgate.processes p
         WHERE p.kind = 'supervisor'
           AND p.last_heartbeat_at < now() - make_interval(secs => alive_threshold_seconds)
        RETURNING p.id
    LOOP
        pruned_id := dead.id;
        released := 0;
        FOR q IN SELECT name FROM lockgate.queues LOOP
            -- Running deliveries of the dead owner (not ones waiting out a retry backoff) that no
            -- claim or heartbeat renewed within the threshold (last_read_at is the last renewal).
            EXECUTE format(
                'WITH silent AS (
                     SELECT m.msg_id FROM %1$s m
                      WHERE m.headers->>''owner'' = $1::text AND m.vt > clock_timestamp()
                        AND NOT m.headers ? ''retry_at''
                        AND m.last_read_at < clock_timestamp() - make_interval(secs => $2)
                      ORDER BY m.msg_id
                        FOR UPDATE SKIP LOCKED),
                 r AS (UPDATE %1$s m SET vt = clock_timestamp() FROM silent WHERE m.msg_id = silent.msg_id RETURNING 1)
                 SELECT count(*) FROM r',
                lockgate._queue_table(q.name, 'q'))
               INTO n USING dead.id, alive_threshold_seconds;
            released := released + n;
        END LOOP;
        RETURN NEXT;
    END LOOP;
END $$;
