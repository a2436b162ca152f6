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
-- For each queue whose table exists, the new index is built beside the old one, which is then
-- dropped, and takes its name. Building it holds the table against writes (claims, completions,
-- enqueues) for as long as the build takes: half a second per million messages on a
-- 2-core machine. An index of that name left by hand is dropped first. The expression is written out here as _rank_sql writes it (a migration
-- keeps the text it ran); tests/upgrade.rs checks that a migrated queue's index and a new
-- queue's are the same.
DO $$
DECLARE
    q record;
BEGIN
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
