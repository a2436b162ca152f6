-- A key is not changed in place (issue 14, docs/design.md §61): neither a semaphore row's, which
-- leases count their permits by and parked jobs wait on, nor a lease's, whose permit belongs to
-- the row it was taken from. Either edit, made by hand, leaves a permit counted by a row that did
-- not give it: the row keeps counting a permit nothing will give back, and the lease gives its
-- permit to a row that never counted it, one too many (G3) or, once that row's jobs are done, a
-- value below zero that fails the sweep for every key and every claim that meets the lease.
-- Migration 19 refuses the deletions; these statement triggers refuse the renames. They fire only
-- for an UPDATE that names key in its SET list, which no lockgate path does: the hot paths' updates
-- (value, lim, updated_at; a lease's expiry) pay one look at the statement's target columns, and
-- no row is locked or read for them, as it would be for a row trigger.
-- Bypassed, as every trigger, by session_replication_role = replica. A lease deleted or inserted
-- by hand stays unguarded, a lease moved by a delete and an insert in one statement included (a
-- check per lease insert or delete is the cost migration 18 removed). The triggers name the key
-- column: a later migration that changes its type drops and creates them again around it.
CREATE OR REPLACE FUNCTION lockgate._refuse_key_change()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'semaphores' THEN
        RAISE EXCEPTION 'lockgate: a semaphore row''s key is not changed: leases count their permits by it and parked jobs wait on it'
            USING ERRCODE = 'restrict_violation',
                  HINT = 'lockgate writes a key''s row when a job first needs it; idle-key reclamation deletes rows nothing names.';
    END IF;
    RAISE EXCEPTION 'lockgate: a lease''s key is not changed: its permit belongs to the row of the key it was taken from'
        USING ERRCODE = 'restrict_violation',
              HINT = 'To end a lease, finish or cancel its job; an expired lease is swept and its permit given back.';
END $$;

DROP TRIGGER IF EXISTS semaphores_key_not_renamed ON lockgate.semaphores;
CREATE TRIGGER semaphores_key_not_renamed BEFORE UPDATE OF key ON lockgate.semaphores
    FOR EACH STATEMENT EXECUTE FUNCTION lockgate._refuse_key_change();
DROP TRIGGER IF EXISTS leases_key_not_moved ON lockgate.leases;
CREATE TRIGGER leases_key_not_moved BEFORE UPDATE OF key ON lockgate.leases
    FOR EACH STATEMENT EXECUTE FUNCTION lockgate._refuse_key_change();
