-- A job's count can wait a moment for its batch: a completion or dead letter that finds the
-- batch's row held by another transaction (a producer that closed the batch and has not
-- committed) no longer waits for it (a wait that outlasted the job's lease made the finished job
-- run again). It records the job's outcome on its membership instead, and whoever next holds the
-- batch's row counts it: a completion of another of its jobs, the close, the batch sweep
-- (docs/design.md §73). NULL while the job has not finished. A nullable column, so adding it
-- rewrites nothing, and code of before this migration never writes it. The partial index is what
-- they probe, empty but for the moment such a membership exists.
ALTER TABLE lockgate.batch_jobs ADD COLUMN IF NOT EXISTS outcome text;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'batch_jobs_outcome_known') THEN
        ALTER TABLE lockgate.batch_jobs
            ADD CONSTRAINT batch_jobs_outcome_known CHECK (outcome IN ('succeeded', 'failed'));
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS batch_jobs_counted_idx ON lockgate.batch_jobs (batch_id) WHERE outcome IS NOT NULL;
