-- Batch totals fixed at the finish (H31, sql/017_batches.sql): an enqueue no longer adds to a
-- batch's total, which updated the batch row and held its lock until the producer committed — so
-- a producer transaction adding jobs of limited keys to a batch deadlocked with a completion that
-- held one of those keys' semaphore rows and counted the batch. The enqueue now only shares the
-- row. Until a batch finishes its total is counted when read (succeeded + failed + memberships);
-- the finish writes it. The check holds for finished batches.
ALTER TABLE lockgate.batches DROP CONSTRAINT batches_counted_within_total;
ALTER TABLE lockgate.batches ADD CONSTRAINT batches_counted_within_total
    CHECK (state <> 'finished' OR succeeded + failed <= total);
COMMENT ON COLUMN lockgate.batches.total IS
    'the number of jobs, written when the batch finishes; before, lockgate.batch() counts succeeded + failed + memberships';
DROP FUNCTION IF EXISTS lockgate._add_to_batch(bigint, integer);
DROP FUNCTION IF EXISTS lockgate._check_batch(bigint);
