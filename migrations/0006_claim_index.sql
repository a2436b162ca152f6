-- Claims order by (priority, visible-at, msg_id) and take one priority at a time, so that a
-- queue holding many delayed or in-flight messages never makes a claim scan them: within a
-- priority the visible messages come first in this index, and the scan stops at the first that
-- is not. It replaces both lockgate's old claim index (priority, msg_id), which a claim had to
-- walk past every delayed message, and PGMQ's vt index, which nothing lockgate runs reads: one
-- index to maintain per insert and claim instead of two. See sql/001_queues.sql and
-- sql/020_claim.sql.
DO $$
DECLARE
    q record;
BEGIN
    FOR q IN SELECT name FROM lockgate.queues LOOP
        EXECUTE format('DROP INDEX IF EXISTS pgmq.%I', 'q_' || q.name || '_lg_prio');
        EXECUTE format('DROP INDEX IF EXISTS pgmq.%I', 'q_' || q.name || '_vt_idx');
        EXECUTE format(
            'CREATE INDEX IF NOT EXISTS %I ON pgmq.%I ((COALESCE((headers->>''priority'')::smallint, 0)), vt, msg_id)',
            'q_' || q.name || '_lg_claim', 'q_' || q.name);
    END LOOP;
END $$;
