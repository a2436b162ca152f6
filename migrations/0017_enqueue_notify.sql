-- lockgate.enqueue and lockgate.enqueue_many take a fourth argument, notify (default true; false
-- leaves the wake-up to the caller, after its commit: sql/010_enqueue.sql). The three-argument
-- forms are dropped so that a call with three arguments, from this build or an older one, names
-- the new functions (sql/ creates them after the migrations); _enqueue_one's sixth argument is
-- renamed from immediate to notify, which CREATE OR REPLACE cannot do.
DROP FUNCTION IF EXISTS lockgate.enqueue(text, jsonb, jsonb);
DROP FUNCTION IF EXISTS lockgate.enqueue_many(text, jsonb[], jsonb);
DROP FUNCTION IF EXISTS lockgate._enqueue_one(lockgate.job_types, jsonb, text, smallint, timestamptz, boolean, text, text, bigint);
