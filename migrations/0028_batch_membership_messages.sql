-- A batch membership names the message its job is on (review helper-131 F1): a completion, a dead
-- letter or a cancel counts a job in its batch only from that message, as a uniqueness lock is
-- released only by its job's own message, so a message written outside lockgate that copies a
-- batched job's id (and its batch header) counts nothing (design §111). 0 for a job parked at enqueue
-- (it has no message; promotion writes its message in); NULL for a membership written before
-- this migration, matched on its job alone, as before. Nullable with no default: adding it
-- rewrites nothing, and code of before it, which never writes it, keeps working.
ALTER TABLE lockgate.batch_jobs ADD COLUMN IF NOT EXISTS msg_id bigint;
