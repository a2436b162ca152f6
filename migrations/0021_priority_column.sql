-- A job's priority is a column of its queue's table, lg_priority, and the claim index is built on
-- it (issue 14, docs/design.md §66). The index was built on the headers' priority, an expression
-- every insert into the queue and every update of a message's visibility (a claim, a heartbeat,
-- a retry) evaluated again; a bulk enqueue of 1,000 jobs spent a tenth of its time in it.
-- lockgate's own writers set the column; a message sent with raw PGMQ gets 0. A CHECK keeps it
-- within 0..9, the priorities the claim probes, so no message can wait behind a priority no
-- claim reads. Existing messages take the priority their headers carry, where it is one of
-- those; any other header value becomes 0, and the claim dead-letters that message as malformed
-- (H29), as it dead-lettered an out-of-range priority before.
-- The column gets its default without a rewrite; the update touches only prioritised messages;
-- the index is built while the table is locked against writes (migrate holds the lock only once
-- it is granted within its lock timeout, and tries again otherwise: design §63).
DO $$
DECLARE
    q record;
BEGIN
    FOR q IN SELECT name FROM lockgate.queues WHERE to_regclass(format('pgmq.%I', 'q_' || name)) IS NOT NULL LOOP
        EXECUTE format('ALTER TABLE pgmq.%I ADD COLUMN IF NOT EXISTS lg_priority smallint NOT NULL DEFAULT 0
                            CONSTRAINT %I CHECK (lg_priority BETWEEN 0 AND 9)',
                       'q_' || q.name, 'q_' || q.name || '_lg_priority');
        EXECUTE format('UPDATE pgmq.%I SET lg_priority = (headers->>''priority'')::smallint
                         WHERE headers ? ''priority'' AND jsonb_typeof(headers) = ''object''
                           AND jsonb_typeof(headers->''priority'') = ''number'' AND headers->>''priority'' ~ ''^[1-9]$''',
                       'q_' || q.name);
        EXECUTE format('DROP INDEX IF EXISTS pgmq.%I', 'q_' || q.name || '_lg_claim');
        EXECUTE format('CREATE INDEX %I ON pgmq.%I (lg_priority, vt, msg_id)', 'q_' || q.name || '_lg_claim', 'q_' || q.name);
    END LOOP;
END $$;
