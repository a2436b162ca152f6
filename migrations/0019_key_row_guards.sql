-- A semaphore row is not deleted or truncated while leases or parked jobs still name its key
-- (issue 14, docs/design.md §61). Migration 18 dropped the leases' foreign key to their rows (its
-- check, planned once per session, read every row at each lease inserted once a session had
-- planned it on few keys); with it went the refusal of a hand edit that leaves a lease counted by
-- no row. Such a lease is then given back to whatever row its key gets next, which counts only its
-- own permits: one permit too many, or a value below zero that fails the sweep for every key and
-- every claim that meets the lease. These statement triggers restore the refusal where only
-- idle-key reclamation pays for it: lockgate deletes a row only when reclamation finds nothing
-- naming it (checked again here, once per statement, by one probe per deleted row). Not
-- checked: a key renamed or a lease moved to another key by hand (a row trigger on an update
-- costs every update of the hot paths, even when it names a column they never set: a BEFORE
-- trigger locks the row before looking, an AFTER trigger reads it again), nor a lease inserted by
-- hand (every lockgate path holds its key's row when it adds one; a check per lease is what
-- migration 18 removed).
-- Bypassed by disabling triggers (session_replication_role = replica).
CREATE OR REPLACE FUNCTION lockgate._refuse_uncounted_keys()
RETURNS trigger LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off SET jit = off AS $$
DECLARE
    k text;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        SELECT l.key INTO k FROM lockgate.leases l LIMIT 1;
        IF NOT FOUND THEN
            SELECT p.key INTO k FROM lockgate.parked p LIMIT 1;
        END IF;
    ELSE
        -- One probe of each key's leases and parked jobs (OFFSET 0 keeps the planner from
        -- turning each EXISTS into a hash of the whole table, which a session planning this on
        -- a large first delete kept for every later one).
        SELECT g.key INTO k FROM gone g
         WHERE EXISTS (SELECT 1 FROM lockgate.leases l WHERE l.key = g.key OFFSET 0)
            OR EXISTS (SELECT 1 FROM lockgate.parked p WHERE p.key = g.key OFFSET 0)
         LIMIT 1;
    END IF;
    IF k IS NOT NULL THEN
        RAISE EXCEPTION 'lockgate: the semaphore row of key "%" is still counted by leases or waited for by parked jobs', k
            USING ERRCODE = 'restrict_violation',
                  HINT = 'Finish, cancel or discard its jobs first (lockgate parked discard, lockgate job cancel); idle-key reclamation deletes rows nothing names.';
    END IF;
    RETURN NULL;
END $$;

-- Row triggers an earlier draft of this migration created (never released; dropped for their
-- cost on every update).
DROP TRIGGER IF EXISTS semaphores_key_kept ON lockgate.semaphores;
DROP TRIGGER IF EXISTS leases_key_counted ON lockgate.leases;
DROP TRIGGER IF EXISTS semaphores_still_counted ON lockgate.semaphores;
CREATE TRIGGER semaphores_still_counted AFTER DELETE ON lockgate.semaphores
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION lockgate._refuse_uncounted_keys();
DROP TRIGGER IF EXISTS semaphores_not_truncated ON lockgate.semaphores;
CREATE TRIGGER semaphores_not_truncated AFTER TRUNCATE ON lockgate.semaphores
    FOR EACH STATEMENT EXECUTE FUNCTION lockgate._refuse_uncounted_keys();
