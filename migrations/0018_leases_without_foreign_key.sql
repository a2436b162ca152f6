-- A lease's key is no longer a foreign key to its semaphore row (issue 14, docs/design.md §60).
-- The server planned the key's check once per session, outside the settings every completion
-- statement runs under, and a plan made while the semaphores were few read them all, at every
-- lease inserted, once they were thousands. Nothing relied on the check: every path that adds a
-- lease holds its key's semaphore row locked first (G3 rests on that lock), reclaiming an idle
-- key deletes its row only under that lock and only with no lease, and check_invariants reports a
-- lease whose key has no row.
DO $$
DECLARE
    fk name;
BEGIN
    FOR fk IN SELECT c.conname FROM pg_constraint c
               WHERE c.conrelid = 'lockgate.leases'::regclass AND c.contype = 'f'
                 AND c.confrelid = 'lockgate.semaphores'::regclass LOOP
        EXECUTE format('ALTER TABLE lockgate.leases DROP CONSTRAINT %I', fk);
    END LOOP;
END $$;
