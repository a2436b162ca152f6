-- Pausing a queue, and capping the shutdown returns that are not counted as attempts (issue 12).
-- A paused queue (paused_at set) is skipped by every claim; producers still enqueue into it and
-- running jobs finish. The pause is a row, so it survives restarts and holds for every process.
ALTER TABLE lockgate.queues ADD COLUMN paused_at timestamptz;

-- Functions whose signatures change in this version; sql/ recreates them.
DROP FUNCTION IF EXISTS lockgate.release(text, bigint[], integer[]);
DROP FUNCTION IF EXISTS lockgate.queue_stats();
