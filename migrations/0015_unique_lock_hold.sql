-- A while_executing lock of a job cancelled while it ran is kept until its handler has stopped
-- (sql/045_cancel.sql): held_until is when the cancelled delivery's visibility ended, the latest
-- instant its worker's watchdog lets the handler run (H27). NULL: held by its job until one of
-- the job's own steps releases it. Nullable, so processes of the previous build run on (§44).
ALTER TABLE lockgate.unique_locks ADD COLUMN held_until timestamptz;
