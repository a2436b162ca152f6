-- An enqueue of many jobs of a type both unique and limited takes all its unique keys before any
-- concurrency key (docs/design.md §74): lockgate._enqueue_one takes a tenth argument, the id of
-- a job whose unique key its caller has taken already. Its nine-argument form goes; the functions
-- installed after this migration define the new one.
DROP FUNCTION IF EXISTS lockgate._enqueue_one(lockgate.job_types, jsonb, text, smallint, timestamptz, boolean, text, text, bigint);
