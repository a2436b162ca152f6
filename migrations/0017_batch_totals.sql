-- Batch totals fixed at close (H31, sql/017_batches.sql): an enqueue no longer adds to a batch's
-- total, which would update the batch row and hold its lock until the producer commits — so a
-- producer transaction adding jobs of limited keys to a batch deadlocked with a completion that
-- held one of those keys' semaphore rows and counted the batch. The enqueue now only shares the
-- row; close_batch fixes the total (succeeded + failed + the memberships left), and while a batch
-- is open its total is counted when read. succeeded + failed may pass the stale total of an open
-- batch, so the check holds from the close on.
ALTER TABLE lockgate.batches DROP CONSTRAINT batches_counted_within_total;
ALTER TABLE lockgate.batches ADD CONSTRAINT batches_counted_within_total
    CHECK (state = 'open' OR succeeded + failed <= total);
COMMENT ON COLUMN lockgate.batches.total IS
    'the number of jobs, fixed when the batch closes; while open, lockgate.batch() counts succeeded + failed + memberships';
DROP FUNCTION IF EXISTS lockgate._add_to_batch(bigint, integer);
DROP FUNCTION IF EXISTS lockgate._check_batch(bigint);
