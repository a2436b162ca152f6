-- A job's id is the msg_id of its first message: every lockgate queue draws its msg_ids from
-- lockgate.job_id_seq (which parked jobs also draw from) instead of a sequence of its own, so a
-- msg_id is unique across queues and a freshly enqueued job needs no id in its headers. A job
-- sent again as a new message (promoted from the parked jobs, retried from the dead letters)
-- keeps its id in the headers' job_id. See sql/001_queues.sql and docs/design.md.
DO $$
DECLARE
    q record;
    top bigint;
    highest bigint := 0;
BEGIN
    FOR q IN SELECT name FROM lockgate.queues LOOP
        EXECUTE format('SELECT GREATEST((SELECT max(msg_id) FROM pgmq.%I), (SELECT max(msg_id) FROM pgmq.%I))',
                       'q_' || q.name, 'a_' || q.name)
           INTO top;
        highest := GREATEST(highest, COALESCE(top, 0));
        EXECUTE format('ALTER TABLE pgmq.%I ALTER COLUMN msg_id DROP IDENTITY IF EXISTS', 'q_' || q.name);
        EXECUTE format('ALTER TABLE pgmq.%I ALTER COLUMN msg_id SET DEFAULT nextval(''lockgate.job_id_seq'')',
                       'q_' || q.name);
    END LOOP;
    -- New ids start above every msg_id and every job id handed out so far.
    IF highest > (SELECT last_value FROM lockgate.job_id_seq) THEN
        PERFORM setval('lockgate.job_id_seq', highest);
    END IF;
END $$;
