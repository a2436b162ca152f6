-- The process registry. register_process inserts one row (a supervisor, or a service owned by
-- one); heartbeat_processes renews a process's rows and returns the ids that still exist (a
-- missing supervisor id means this process was pruned: it must stop, hand back, re-register);
-- prune_processes deletes supervisors silent past the alive threshold (their services go with
-- them, ON DELETE CASCADE). It leaves their jobs alone: a process silent in the registry may be
-- alive (its registry heartbeat stalled while its job heartbeats went on, seed 000, H26), or
-- partitioned and about to stop its handlers by its own clock (H27); either way its deliveries'
-- budgets are theirs until they run out, and only then do the jobs come back. Making them
-- visible sooner would run a job twice at once. A process that finds its own row gone
-- re-registers and keeps its jobs.
-- Locks: process rows. Callers: the runtime's registry service; lockgate status; operators.

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

-- Returns the ids of the supervisors it pruned and how many of their jobs are still in flight
-- (they come back when their visibility lapses).
CREATE OR REPLACE FUNCTION lockgate.prune_processes(alive_threshold_seconds double precision)
RETURNS TABLE (pruned_id bigint, in_flight bigint) LANGUAGE plpgsql AS $$
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
        in_flight := 0;
        FOR q IN SELECT lockgate._live_queues() AS name LOOP
            -- Through the claim index, priority by priority: only messages invisible now (in
            -- flight, delayed, waiting to retry) are read, however long the visible backlog.
            EXECUTE format(
                'SELECT count(*) FROM %s m
                  WHERE %s = ANY (''{-1,0,1,2,3,4,5,6,7,8,9}''::integer[])
                    AND m.vt > $2 AND m.headers->>''owner'' = $1::text AND NOT m.headers ? ''retry_at''',
                lockgate._queue_table(q.name, 'q'), lockgate._rank_sql('m.headers'))
               INTO n USING dead.id, clock_timestamp();
            in_flight := in_flight + n;
        END LOOP;
        RETURN NEXT;
    END LOOP;
END $$;
