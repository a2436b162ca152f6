-- The claim index's first column becomes an expression that never raises (lockgate._rank_sql in
-- sql/001_queues.sql): a priority header of 0..9 is its value, a missing or null one 0, and
-- anything else -1, which every claim probes first. The cast it replaces,
-- COALESCE((headers->>'priority')::smallint, 0), failed the insert of a raw PGMQ message whose
-- priority it could not cast ("high", 1.5, 99999) and the adoption of a PGMQ queue holding one,
-- and put 12 or -1 outside the ranks a claim probes, where only a claim of an idle queue found
-- them (H29). Nothing that writes a message changes: the index computes the rank itself, so a
-- producer running the functions of before this migration, waiting on the table while it runs,
-- inserts a message the new index ranks right (docs/design.md §66, §67).
--
-- Every queue table whose index is rebuilt is locked first (ACCESS EXCLUSIVE, which the old
-- index's drop needs), so that a lock another session holds ends migrate's attempt before any
-- index is built (migrate waits 500 ms for a lock, then tries again: design §63). Then for each
-- queue the new index is built beside the old one, which is dropped, and takes its name; an
-- index of the new one's name left by hand is dropped first. The queues stay locked, against
-- reads as well as writes, until migrate commits: about half a second per million messages on a
-- 2-core machine. The expression is written out here as _rank_sql wrote it when this migration
-- was made; with each install of the functions, lockgate._install_claim_indexes builds again any
-- claim index that differs from the one create_queue builds then (design §67).
DO $$
DECLARE
    q record;
BEGIN
    FOR q IN SELECT name FROM lockgate.queues WHERE to_regclass(format('pgmq.%I', 'q_' || name)) IS NOT NULL ORDER BY name LOOP
        EXECUTE format('LOCK TABLE pgmq.%I IN ACCESS EXCLUSIVE MODE', 'q_' || q.name);
    END LOOP;
    FOR q IN SELECT name FROM lockgate.queues WHERE to_regclass(format('pgmq.%I', 'q_' || name)) IS NOT NULL LOOP
        EXECUTE format('DROP INDEX IF EXISTS pgmq.%I', 'q_' || q.name || '_lg_rank');
        EXECUTE format(
            'CREATE INDEX %I ON pgmq.%I ((CASE WHEN headers->>''priority'' IS NULL THEN 0 '
            'ELSE COALESCE(array_position(''{0,1,2,3,4,5,6,7,8,9}''::text[], headers->>''priority'') - 1, -1) END), '
            'vt, msg_id)',
            'q_' || q.name || '_lg_rank', 'q_' || q.name);
        EXECUTE format('DROP INDEX IF EXISTS pgmq.%I', 'q_' || q.name || '_lg_claim');
        EXECUTE format('ALTER INDEX pgmq.%I RENAME TO %I', 'q_' || q.name || '_lg_rank', 'q_' || q.name || '_lg_claim');
    END LOOP;
END $$;
