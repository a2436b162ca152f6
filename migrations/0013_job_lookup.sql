-- Finding a job by id in every state (issue 12). A job's id is the msg_id of its first message;
-- a job sent again as a new message (promoted, re-parked at claim, retried from the dead letters)
-- carries it in its headers' job_id. These partial indexes find those messages, in the queue and
-- in the archive, without a scan; messages without a job_id header (most) are not in them and
-- are found by msg_id. Parked jobs and dead letters have their job_id indexes already.
-- lockgate.create_queue creates the same indexes for new queues (sql/001_queues.sql).
DO $$
DECLARE
    q record;
    kind text;
BEGIN
    FOR q IN SELECT name FROM lockgate.queues WHERE to_regclass(format('pgmq.%I', 'q_' || name)) IS NOT NULL LOOP
        FOREACH kind IN ARRAY ARRAY['q', 'a'] LOOP
            EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON pgmq.%I ((headers->>''job_id'')) WHERE headers ? ''job_id''',
                           kind || '_' || q.name || '_lg_job', kind || '_' || q.name);
        END LOOP;
    END LOOP;
END $$;
