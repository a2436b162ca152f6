-- The load of scripts/held-key-throughput, on a freshly migrated database.
SELECT lockgate.create_queue('held');
SELECT lockgate.define_job_type('hot', queue => 'held', concurrency_limit => 4, concurrency_key => ARRAY['k'],
                                concurrency_duration_ms => 10000);
CREATE SCHEMA held_key;
CREATE TABLE held_key.done (at timestamptz DEFAULT clock_timestamp(), msg_id bigint);

-- A worker: claims one job, runs it 20 ms and completes it, each step a transaction of its own.
CREATE PROCEDURE held_key.worker(secs double precision) LANGUAGE plpgsql AS $$
DECLARE
    d record;
    until timestamptz := clock_timestamp() + make_interval(secs => secs);
BEGIN
    WHILE clock_timestamp() < until LOOP
        SELECT msg_id, read_ct INTO d FROM lockgate.claim('held', 1, 30);
        COMMIT;
        IF d.msg_id IS NULL THEN
            PERFORM pg_sleep(0.005);
            CONTINUE;
        END IF;
        PERFORM pg_sleep(0.02);
        INSERT INTO held_key.done (msg_id) VALUES (d.msg_id);
        PERFORM * FROM lockgate.complete('held', ARRAY[d.msg_id], ARRAY[d.read_ct]);
        COMMIT;
    END LOOP;
END $$;

-- The producer: enqueues a job of the key and holds its transaction 25 ms, then idles 25 ms.
CREATE PROCEDURE held_key.producer(secs double precision) LANGUAGE plpgsql AS $$
DECLARE
    until timestamptz := clock_timestamp() + make_interval(secs => secs);
BEGIN
    WHILE clock_timestamp() < until LOOP
        PERFORM * FROM lockgate.enqueue('hot', '{"k": 1}');
        PERFORM pg_sleep(0.025);
        COMMIT;
        PERFORM pg_sleep(0.025);
    END LOOP;
END $$;

-- The sweep, every 5 s, as lockgate run's default sweep_interval.
CREATE PROCEDURE held_key.sweeper(secs double precision) LANGUAGE plpgsql AS $$
DECLARE
    until timestamptz := clock_timestamp() + make_interval(secs => secs);
BEGIN
    WHILE clock_timestamp() < until LOOP
        PERFORM lockgate.sweep();
        COMMIT;
        PERFORM pg_sleep(5);
    END LOOP;
END $$;

-- A backlog the workers cannot finish in 15 s.
SELECT count(*) FROM (SELECT lockgate.enqueue('hot', '{"k": 1}') FROM generate_series(1, 3000)) x;
