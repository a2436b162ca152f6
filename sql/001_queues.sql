-- Queues: lockgate.create_queue creates the PGMQ pair and lockgate's claim index in one
-- transaction; lockgate._queue_table resolves a queue name to its quoted PGMQ table or raises
-- LG001. Every function that touches a queue's table goes through _queue_table (or, as the
-- claim does, reads the queue's row itself and calls it only to raise), so no unknown or
-- malformed name can reach a dynamic statement.
--
-- Error codes raised by lockgate's functions (matched by the Rust layer):
--   LG001 unknown queue · LG002 unknown job type · LG003 invalid argument
--   LG004 concurrency limit reached (on_conflict raise) · LG005 unique key held (reject)
--   LG006 unknown recurring task

CREATE OR REPLACE FUNCTION lockgate._queue_table(queue text, kind text)
RETURNS text LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM lockgate.queues q WHERE q.name = _queue_table.queue) THEN
        RAISE EXCEPTION 'lockgate: queue "%" does not exist', queue
            USING ERRCODE = 'LG001',
                  HINT = 'create it with lockgate.create_queue(name), or define a job type on that queue';
    END IF;
    RETURN format('pgmq.%I', kind || '_' || queue);
END $$;

-- The first column of a queue's claim index, as SQL text over the headers expression given
-- (`headers`, `m.headers`): a message's priority 0..9, a missing or null one read as 0, and -1
-- for anything else its headers may hold (a raw PGMQ message's "high", 1.5, 12, -1, true...).
-- It never raises, whatever the headers are, so no message content can fail the insert or
-- update that maintains the index (H29); and a claim probes -1 first, so such a message is
-- taken, and dead-lettered for its priority (lockgate._malformed), by the next claim of its
-- queue however busy that queue is. Every statement that reads the index writes this same
-- expression, and migration 21 built the index of every existing queue from it. A test for the
-- common case (no priority header: lockgate writes none for 0) and a lookup in a constant array,
-- not a CASE of ten branches: PostgreSQL prepares an index's expressions again for every
-- statement that inserts or updates a row, and that CASE cost each claim and enqueue about 4 us
-- more; this costs what the cast did at priority 0 (docs/design.md §67).
CREATE OR REPLACE FUNCTION lockgate._rank_sql(headers text)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT format('CASE WHEN %1$s->>''priority'' IS NULL THEN 0 '
                  'ELSE COALESCE(array_position(''{0,1,2,3,4,5,6,7,8,9}''::text[], %1$s->>''priority'') - 1, -1) END',
                  headers)
$$;

-- Whether queue's table was made again outside lockgate after lockgate made or adopted it
-- (pgmq.drop_queue, then pgmq.create): its msg_id is PGMQ's identity column again, numbering
-- from 1, not lockgate.job_id_seq, so its ids would repeat other jobs' ids, and the fencing tokens
-- (msg_id, read_ct) of deliveries of the dropped table would match its new messages. False for a
-- queue whose table is missing. Locks: none. Callers: _live_queues, create_queue, the install,
-- check_invariants, every claim (twice when it takes a message). PL/pgSQL, which keeps its
-- statement's plan for the session: as a SQL function (its subquery keeps it from being inlined)
-- it was planned again at every claim, about 95 us of an empty claim's 0.4 ms of server time,
-- two claims per job on an idle queue (docs/benchmarks.md, twenty-fourth session).
-- A table found as lockgate made it is remembered by its oid for the session (the setting
-- lockgate.adopted_<queue>), and a later call that finds the same oid reads no catalog table:
-- the query, even planned once, cost about 35 us per transaction, twice in every claim that took
-- a message (docs/design.md §88). A table made again is another table, with another oid, and is
-- looked at in full; only an ALTER by hand that makes the same table's msg_id an identity column
-- again goes unseen by sessions that looked before it.
CREATE OR REPLACE FUNCTION lockgate._made_again(queue text)
RETURNS boolean LANGUAGE plpgsql STABLE AS $$
DECLARE
    tbl oid := to_regclass(format('pgmq.%I', 'q_' || queue));
    memo text := 'lockgate.adopted_' || queue;
    identity "char";
BEGIN
    IF tbl IS NULL THEN
        RETURN false;
    ELSIF tbl::text = current_setting(memo, true) THEN
        RETURN false;
    END IF;
    SELECT a.attidentity INTO identity FROM pg_catalog.pg_attribute a
     WHERE a.attrelid = tbl AND a.attname = 'msg_id';
    -- Remembered only when the column was seen, and is no identity: to_regclass reads the latest
    -- catalog, the query the transaction's snapshot, which under REPEATABLE READ may be older than
    -- a table made again since and not see its columns at all (review helper-91: remembered so,
    -- the session's next claims took the new table's messages).
    IF NOT FOUND THEN
        RETURN false;
    ELSIF identity = '' THEN
        PERFORM set_config(memo, tbl::text, false);
    END IF;
    RETURN identity <> '';
END $$;

-- The queues whose PGMQ table exists as lockgate made or adopted it: loops over every queue
-- (sweep, prune, invariants, status) skip a queue whose table was dropped behind lockgate's back
-- (pgmq.drop_queue) instead of failing for every other queue, and a queue whose table was made
-- again behind its back (pgmq.create) until lockgate adopts it again (create_queue, which every
-- migrate runs for such a queue). check_invariants reports both.
CREATE OR REPLACE FUNCTION lockgate._live_queues()
RETURNS SETOF text LANGUAGE sql STABLE AS $$
    SELECT q.name FROM lockgate.queues q
     WHERE to_regclass(format('pgmq.%I', 'q_' || q.name)) IS NOT NULL AND NOT lockgate._made_again(q.name)
     ORDER BY q.name
$$;

-- The queues whose claim index is not the one lockgate.create_queue builds now, each with what is
-- wrong: missing, not valid (a build that failed halfway leaves an index that looks right and
-- serves nothing), unique, or of another definition. A claim statement matches an index only when
-- both write the same rank (lockgate._rank_sql); where they differ, every claim reads the whole
-- queue. The expected definition is read from the index lockgate.claim_index_probe_rank, built by
-- each install on lockgate.claim_index_probe, an empty table of the same columns
-- (migrations/0022_claim_index_probe.sql), as PostgreSQL shows it (its text depends on
-- PostgreSQL's version, not on how the expression was written), and compared with each queue's
-- from its access method on. When that index is missing, every queue is returned. taken_by names
-- the relation that holds the index's name when it is not an index of the queue's table (a
-- queue named <queue>_lg_claim, made before lockgate.create_queue refused such names: its table
-- is pgmq.q_<queue>_lg_claim): no index can be built under that name, and the install leaves
-- such a queue to the doctor, which names both. Locks: none. Callers:
-- lockgate._install_claim_indexes, doctor (claim_indexes).
-- Revision 47's form returned no taken_by; a result type cannot be replaced, so that one is
-- dropped. Only that one: a function dropped and made again has a new oid, and a doctor running
-- it while an install commits would fail ("cache lookup failed for function").
DO $$
BEGIN
    IF pg_get_function_result(to_regprocedure('lockgate._stale_claim_indexes()')) = 'TABLE(queue text, why text)' THEN
        DROP FUNCTION lockgate._stale_claim_indexes();
    END IF;
END $$;
CREATE OR REPLACE FUNCTION lockgate._stale_claim_indexes()
RETURNS TABLE (queue text, why text, taken_by text)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    WITH expected AS (
        SELECT regexp_replace(pg_get_indexdef(to_regclass('lockgate.claim_index_probe_rank')), '^.*? USING ', '') AS def),
    named AS (
        SELECT l.q, c.oid AS rel, c.relkind, to_regclass(format('pgmq.%I', 'q_' || l.q)) AS tbl
          FROM lockgate._live_queues() l(q)
          LEFT JOIN pg_class c ON c.oid = to_regclass(format('pgmq.%I', 'q_' || l.q || '_lg_claim')))
    SELECT n.q,
           CASE WHEN i.indexrelid IS NULL THEN 'missing'
                WHEN NOT i.indisvalid OR NOT i.indisready THEN 'not valid'
                WHEN i.indisunique THEN 'unique'
                ELSE format('of another definition (%s)',
                            regexp_replace(regexp_replace(pg_get_indexdef(i.indexrelid), '^.*? USING ', ''), '\s+', ' ', 'g'))
           END,
           CASE WHEN n.rel IS NOT NULL AND i.indexrelid IS NULL
                THEN format('%s pgmq.%I',
                            CASE n.relkind WHEN 'r' THEN 'the table' WHEN 'i' THEN 'an index of another table'
                                           WHEN 'S' THEN 'the sequence' WHEN 'v' THEN 'the view' ELSE 'the relation' END,
                            'q_' || n.q || '_lg_claim')
           END
      FROM named n
     CROSS JOIN expected e
      LEFT JOIN pg_index i ON i.indexrelid = n.rel AND i.indrelid = n.tbl
     WHERE i.indexrelid IS NULL OR NOT i.indisvalid OR NOT i.indisready OR i.indisunique
        OR regexp_replace(pg_get_indexdef(i.indexrelid), '^.*? USING ', '') IS DISTINCT FROM e.def
     ORDER BY n.q
$$;

-- Every queue's claim index, built again where lockgate._stale_claim_indexes finds it wrong, after
-- the reference index it compares with is brought up to date. The reference index is built anew
-- beside the one in place and kept only when its definition differs (an upgrade of the rank or of
-- PostgreSQL), so that an install that changes nothing leaves it alone: a doctor reading it while
-- a migrate runs never meets it dropped. Nothing else is locked when every claim index is right.
-- Else every table to rebuild is locked first, in name order (ACCESS EXCLUSIVE, which the old
-- index's drop needs), so that a lock another session holds ends migrate's attempt before any
-- index is built (migrate waits 500 ms for a lock, then tries again: design §63); then each new
-- index is built beside the old one under a name no PGMQ relation can have (PGMQ's start with
-- q_, a_ or archived_at_idx_), the old one is dropped, and the new one takes its name. A queue
-- whose index name another relation holds is skipped (taken_by): the doctor names it. Run with
-- each install of these functions (the end of sql/020_claim.sql), so a database that ran an
-- earlier text of migration 21, or whose index was dropped or rebuilt by hand, is put right by
-- the next migrate. Callers: the install.
CREATE OR REPLACE FUNCTION lockgate._install_claim_indexes()
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET client_min_messages = warning AS $$
DECLARE
    stale text[];
    q text;
BEGIN
    DROP INDEX IF EXISTS lockgate.claim_index_probe_next;
    EXECUTE format('CREATE INDEX claim_index_probe_next ON lockgate.claim_index_probe ((%s), vt, msg_id)',
                   lockgate._rank_sql('headers'));
    IF regexp_replace(pg_get_indexdef('lockgate.claim_index_probe_next'::regclass), '^.*? USING ', '')
       IS NOT DISTINCT FROM
       regexp_replace(pg_get_indexdef(to_regclass('lockgate.claim_index_probe_rank')), '^.*? USING ', '') THEN
        DROP INDEX lockgate.claim_index_probe_next;
    ELSE
        DROP INDEX IF EXISTS lockgate.claim_index_probe_rank;
        ALTER INDEX lockgate.claim_index_probe_next RENAME TO claim_index_probe_rank;
    END IF;
    SELECT array_agg(s.queue ORDER BY s.queue) INTO stale FROM lockgate._stale_claim_indexes() s WHERE s.taken_by IS NULL;
    IF stale IS NULL THEN
        RETURN;
    END IF;
    FOREACH q IN ARRAY stale LOOP
        EXECUTE format('LOCK TABLE pgmq.%I IN ACCESS EXCLUSIVE MODE', 'q_' || q);
    END LOOP;
    FOREACH q IN ARRAY stale LOOP
        EXECUTE format('CREATE INDEX %I ON pgmq.%I ((%s), vt, msg_id)',
                       'lg_rebuild_' || q, 'q_' || q, lockgate._rank_sql('headers'));
        EXECUTE format('DROP INDEX IF EXISTS pgmq.%I', 'q_' || q || '_lg_claim');
        EXECUTE format('ALTER INDEX pgmq.%I RENAME TO %I', 'lg_rebuild_' || q, 'q_' || q || '_lg_claim');
    END LOOP;
END $$;

-- From functions revision 28 each step's name and arguments come from lockgate._steps(), and from
-- revision 31 its settings are written once, as a list. The earlier signatures of the step
-- writer (called only by the installers, replaced in the same transaction) are dropped; so is
-- revision 25's three-argument trust check, which made revision 26's calls ambiguous. Revision
-- 26's trust check stays, calling the new one (below).
DROP FUNCTION IF EXISTS lockgate._write_step(text, text, text, text, text, text, text[]);
DROP FUNCTION IF EXISTS lockgate._write_step(text, text, text, text, text, text[]);
DROP FUNCTION IF EXISTS lockgate._trusted_step(text, regtype[], regprocedure);

-- A queue's generated steps, one row each: the prefix of its name (the queue's name follows; no
-- other lockgate function starts with one), its argument types, and the function that writes
-- it. The one list that lockgate._write_step, lockgate._trusted_step, `lockgate doctor`
-- (queue_steps) and the tests read: a new step is a row here, its installer, and its caller.
-- Type names are qualified, so that no session's search_path can read them as other types.
CREATE OR REPLACE FUNCTION lockgate._steps()
RETURNS TABLE (prefix text, args regtype[], installer text)
LANGUAGE sql STABLE AS $$
    VALUES ('_claim_take_', '{pg_catalog.int4,pg_catalog.float8,pg_catalog.int8,pg_catalog.timestamptz,pg_catalog.int4,pg_catalog.text}'::regtype[],
            'lockgate._install_claim_steps(text)'),
           ('_enqueue_into_', '{pg_catalog.timestamptz,pg_catalog.jsonb[],pg_catalog.jsonb}'::regtype[],
            'lockgate._install_enqueue_steps(text)'),
           ('_enqueue1_into_', '{pg_catalog.timestamptz,pg_catalog.jsonb,pg_catalog.jsonb}'::regtype[],
            'lockgate._install_enqueue_steps(text)'),
           ('_complete_into_', '{pg_catalog.int8[],pg_catalog.int4[],pg_catalog.int8[],pg_catalog.int4[]}'::regtype[],
            'lockgate._install_complete_steps(text)'),
           ('_promote_into_', '{lockgate.promotion[],pg_catalog.text}'::regtype[], 'lockgate._install_promote_steps(text)')
$$;

-- Writes one of a queue's generated steps (lockgate.<prefix><queue>(<its arguments in
-- lockgate._steps()>) RETURNS <returns>, with the settings, e.g. {enable_seqscan=off}, as its
-- SET clauses), a PL/pgSQL function with the queue's table named in its body, so that its
-- statements are planned once per session: the claim step, sql/020_claim.sql; the enqueue
-- steps, sql/010_enqueue.sql; the promotion step, sql/015_concurrency.sql; the completion step,
-- sql/040_complete.sql). Idempotent: a step
-- that exists as it would be written (same body, settings and owner) is left alone, without a
-- lock, so installing again costs nothing and disturbs no caller. A step to write is written
-- under create_queue's advisory lock on the queue name: in place (CREATE OR REPLACE, keeping
-- whatever depends on it) when it is the installer's own (dropped first when its result type
-- is another); dropped and created anew when it
-- belongs to anyone else (planted under the step's name: never kept; the drop fails rather than
-- cascade, and fails for an installer that may not drop it). Then every other function under
-- the step's name (an overload with an extra defaulted argument would make the callers' call
-- ambiguous) and under the names in stale (an earlier revision's steps) is dropped under the
-- same lock; one that something depends on, or that the installer may not drop (another
-- role's, when the installer is neither a superuser nor the schema's owner), is kept, with a
-- warning naming it, rather than fail the install. Whatever is left, the callers run a step
-- only once lockgate._trusted_step trusts it, and `lockgate doctor` names it (queue_steps).
-- Runs as its caller: called by the SECURITY DEFINER installers, as the role that installed
-- lockgate's functions, with every argument typed (so that no overload of this function another
-- role adds is a better match); called directly by another role, it runs as that role.
-- Locks: none when nothing changes; else the queue name's advisory lock, then catalog rows.
-- Callers: lockgate._install_claim_steps, lockgate._install_enqueue_steps,
-- lockgate._install_complete_steps, lockgate._install_promote_steps (SECURITY DEFINER).
CREATE OR REPLACE FUNCTION lockgate._write_step(queue text, prefix text, returns text, settings text[], body text,
                                                stale text[])
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET client_min_messages = warning AS $$
DECLARE
    name text := prefix || queue;
    args text := (SELECT array_to_string(s.args, ', ') FROM lockgate._steps() s WHERE s.prefix = _write_step.prefix);
    head text := 'RETURNS ' || returns || ' LANGUAGE plpgsql'
                 || COALESCE((SELECT string_agg(format(' SET %s = %s', split_part(c.s, '=', 1), split_part(c.s, '=', 2)), ''
                                                ORDER BY c.o)
                                FROM unnest(settings) WITH ORDINALITY c(s, o)), '');
    found record;
    other record;
    dependents text;
BEGIN
    IF args IS NULL THEN
        RAISE EXCEPTION 'lockgate: "%" is not the prefix of a queue step (lockgate._steps())', prefix;
    END IF;
    FOR pass IN 1 .. 2 LOOP
        -- The owner by its name as it is (to_regrole would read current_user as SQL syntax:
        -- lowercased, and refused with a dot or a space in it).
        SELECT p.oid,
               p.prosrc = body AND p.proconfig IS NOT DISTINCT FROM settings
                 AND p.prolang = (SELECT l.oid FROM pg_language l WHERE l.lanname = 'plpgsql')
                 AND NOT p.prosecdef AND NOT p.proisstrict AND p.provolatile = 'v' AS same,
               p.proowner = (SELECT r.oid FROM pg_roles r WHERE r.rolname = current_user) AS ours
          INTO found
          FROM pg_proc p
         WHERE p.pronamespace = 'lockgate'::regnamespace AND p.proname = name
           AND pg_get_function_identity_arguments(p.oid) = args;
        EXIT WHEN found.oid IS NOT NULL AND found.same AND found.ours;
        IF pass = 1 THEN
            -- Something to write: look again once no other writer of this queue's steps runs.
            PERFORM pg_advisory_xact_lock(hashtext('lockgate.queue:' || queue));
            CONTINUE;
        END IF;
        IF found.oid IS NOT NULL AND NOT found.ours THEN
            BEGIN
                EXECUTE format('DROP FUNCTION lockgate.%I(%s)', name, args);
            EXCEPTION WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'lockgate: lockgate.%(%) belongs to role %, and % may not replace it', name, args,
                                pg_get_userbyid((SELECT p.proowner FROM pg_proc p WHERE p.oid = found.oid)), current_user
                    USING ERRCODE = 'insufficient_privilege',
                          HINT = 'drop it as its owner or a superuser, then run lockgate migrate; lockgate runs no step it did not write';
            END;
        END IF;
        BEGIN
            EXECUTE format('CREATE OR REPLACE FUNCTION lockgate.%I(%s) %s AS %L', name, args, head, body);
        EXCEPTION WHEN invalid_function_definition THEN
            -- The installer's own step of another revision with another result type (revision
            -- 44's bulk enqueue step returned its ids as an array, the others a set; design §68),
            -- which no CREATE OR REPLACE may change: dropped and created anew. A drop that
            -- something depends on fails the install, naming it.
            BEGIN
                EXECUTE format('DROP FUNCTION lockgate.%I(%s)', name, args);
            EXCEPTION WHEN dependent_objects_still_exist THEN
                GET STACKED DIAGNOSTICS dependents = PG_EXCEPTION_DETAIL;
                RAISE EXCEPTION 'lockgate: lockgate.%(%) must be replaced, its result type having changed, and other objects depend on it',
                                name, args
                    USING ERRCODE = 'dependent_objects_still_exist', DETAIL = dependents,
                          HINT = 'drop what depends on it, run lockgate migrate, then create it again';
            END;
            EXECUTE format('CREATE FUNCTION lockgate.%I(%s) %s AS %L', name, args, head, body);
        END;
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_proc p
                WHERE p.pronamespace = 'lockgate'::regnamespace
                  AND (p.proname = ANY (stale) OR (p.proname = name AND pg_get_function_identity_arguments(p.oid) <> args))) THEN
        PERFORM pg_advisory_xact_lock(hashtext('lockgate.queue:' || queue));
        FOR other IN SELECT p.oid::regprocedure AS f FROM pg_proc p
                      WHERE p.pronamespace = 'lockgate'::regnamespace
                        AND (p.proname = ANY (stale) OR (p.proname = name AND pg_get_function_identity_arguments(p.oid) <> args)) LOOP
            BEGIN
                EXECUTE format('DROP FUNCTION %s', other.f);
            EXCEPTION
                WHEN dependent_objects_still_exist THEN
                    RAISE WARNING 'lockgate: % is kept, unused: other objects depend on it', other.f
                        USING HINT = 'drop what depends on it, then run lockgate migrate again';
                WHEN insufficient_privilege THEN
                    RAISE WARNING 'lockgate: % is kept: it belongs to another role, which lockgate may not drop', other.f
                        USING HINT = 'drop it as its owner or a superuser, then run lockgate migrate again';
            END;
        END LOOP;
    END IF;
END $$;

-- Whether lockgate.<prefix><queue> is the queue's step as lockgate writes it, for its caller to
-- run: the function under that name with the step's argument types (lockgate._steps()) — looked
-- up as the one function under that name (to_regproc, 0.6 us: NULL when there is none or more
-- than one, so that a caller that falls back never meets an ambiguous call), or, by_signature,
-- as the one of that signature (to_regprocedure and the step's arguments from the list, 8 us in
-- all: other overloads, which the caller's call does not match, do not matter; when the one
-- function under that name is the one this session trusted, that is all it looks up) — which the caller
-- may execute, owned by the owner of the step's installer. The owner and argument types are
-- read from the catalog (a query, about 5 us) once per session and function; the function's oid
-- is then kept in a session setting (lockgate.trusted<step>, e.g.
-- lockgate.trusted_enqueue1_into_mail), and a later call that finds the same oid needs only the
-- lookup and the privilege check (2 us in all; the list is not read). A step dropped and made
-- again, by anyone, has another oid and is checked again. What a kept oid does not see: a step
-- its owner gives to another role (ALTER FUNCTION ... OWNER TO, REASSIGN OWNED), which that role
-- may then rewrite, is trusted by the sessions that checked it before, until they end; give
-- lockgate's functions to no other role. A setting is no secret: whoever can set one in a
-- session could set its search_path as well, and shadow any built-in function lockgate calls
-- there; the memo is against mistakes and other roles' functions, not against the session's own
-- client. Each step adds a setting to a session (PostgreSQL 15 sorts its settings as each is
-- added: the first call per step costs 0.1 ms with a hundred queues, 0.3 ms with thousands).
-- False for a NULL queue or a prefix not in the list. Callers: lockgate._enqueue_step,
-- lockgate.complete, lockgate.claim (by signature: it writes its step again when it finds none
-- it trusts, and an overload it cannot drop must not make it do so at every claim).
CREATE OR REPLACE FUNCTION lockgate._trusted_step(prefix text, queue text, by_signature boolean DEFAULT false)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    step text := prefix || queue;
    args regtype[];
    step_oid oid;
    memo text := 'lockgate.trusted' || step;
    trusted boolean;
BEGIN
    IF step IS NULL THEN
        RETURN false;
    ELSIF by_signature THEN
        -- The one function of that name, if this session trusted it already: the list and the
        -- signature's parse (about 20 us per transaction) are needed only when it is not.
        step_oid := to_regproc(format('lockgate.%I', step));
        IF step_oid IS NULL OR step_oid::text IS DISTINCT FROM current_setting(memo, true) THEN
            SELECT x.args INTO args FROM lockgate._steps() x WHERE x.prefix = _trusted_step.prefix;
            step_oid := to_regprocedure(format('lockgate.%I(%s)', step, array_to_string(args, ', ')));
        END IF;
    ELSE
        step_oid := to_regproc(format('lockgate.%I', step));
    END IF;
    trusted := step_oid IS NOT NULL AND has_function_privilege(step_oid, 'EXECUTE');
    IF trusted AND step_oid::text IS DISTINCT FROM current_setting(memo, true) THEN
        SELECT p.proowner = i.proowner AND p.proargtypes = array_to_string(x.args::oid[], ' ')::oidvector
          INTO trusted
          FROM lockgate._steps() x, pg_catalog.pg_proc p, pg_catalog.pg_proc i
         WHERE x.prefix = _trusted_step.prefix AND p.oid = step_oid AND i.oid = x.installer::regprocedure;
        IF trusted THEN
            PERFORM set_config(memo, step_oid::text, false);
        END IF;
    END IF;
    RETURN COALESCE(trusted, false);
END $$;

-- Revision 26's trust check, which its callers gave the step's whole name, argument types and
-- installer: kept for the sessions that still run revision 26's functions while a migrate
-- replaces them (a claim or completion that began before the migrate's commit calls it after),
-- which would otherwise fail for a missing function. It finds the step's prefix in the list and
-- asks the check above. A later revision drops it.
CREATE OR REPLACE FUNCTION lockgate._trusted_step(step text, args regtype[], installer regprocedure,
                                                   alone boolean DEFAULT true)
RETURNS boolean LANGUAGE sql AS $$
    SELECT COALESCE((SELECT lockgate._trusted_step(x.prefix, substr(step, length(x.prefix) + 1), NOT alone)
                       FROM lockgate._steps() x WHERE starts_with(step, x.prefix)), false)
$$;

-- Creates a queue if it does not exist. Safe to run from many sessions at once (H21): the
-- advisory lock serialises creators of the same name until commit. A queue whose row is already
-- visible was created whole (its row is inserted in the transaction that creates everything
-- else), so the common call, for a queue that exists, returns before the lock: processes
-- starting together do not queue behind each other's commits. A table dropped since, behind
-- lockgate's back (pgmq.drop_queue), is not made again here, with or without the lock:
-- check_invariants reports such a queue. A table made again behind lockgate's back (pgmq.create)
-- is adopted again, as a PGMQ queue lockgate never knew is: its ids from lockgate.job_id_seq,
-- above every id of its tables, its indexes built and its steps written for the new table.
-- Leases, parked jobs and locks of the dropped table's jobs stay as they were: a lease ends and
-- is freed by the sweep, since its message is gone; a parked job is promoted into the new table.
-- A new queue's name may not end in a suffix that PGMQ or lockgate appends to another queue's
-- name for that queue's own relations (_pkey, _vt_idx, _msg_id_seq, _lg_claim, _lg_job: queue x
-- has the index pgmq.q_x_lg_claim, which a queue x_lg_claim's table would take), and each index
-- it builds must come out as an index of its table: a name another relation holds already (a
-- queue made before these names were refused, or by pgmq.create) is an error naming it, not an
-- index silently skipped. A queue that exists is left alone whatever its name. The search path
-- is fixed, so that the rank written into the claim index is PostgreSQL's own functions whatever
-- the caller's search_path holds.
-- Locks: advisory xact lock on the queue name, when the queue is not visible yet. Callers:
-- migrate, define_job_type, Client, CLI.
CREATE OR REPLACE FUNCTION lockgate.create_queue(queue text)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    top bigint;
    idx record;
    again boolean := false;
BEGIN
    IF queue IS NULL OR queue !~ '^[a-z][a-z0-9_]{0,46}$' THEN
        RAISE EXCEPTION 'lockgate: invalid queue name "%"', queue
            USING ERRCODE = 'LG003',
                  DETAIL = 'a queue name is a lowercase letter followed by lowercase letters, digits or _, at most 47 characters';
    END IF;
    IF EXISTS (SELECT 1 FROM lockgate.queues q WHERE q.name = create_queue.queue) THEN
        IF to_regclass(format('pgmq.%I', 'q_' || queue)) IS NULL THEN
            -- Its table was dropped outside lockgate (pgmq.drop_queue): made again, so that its
            -- dead letters and parked jobs can run, as doctor and `dlq retry` say to do (review
            -- helper-144 F3: this returned doing nothing). Its ids come from lockgate.job_id_seq
            -- as before, so none repeats a dropped message's. A caller that may not create tables
            -- in schema pgmq (a worker's start, define_job_type) leaves it to one that may.
            IF NOT has_schema_privilege('pgmq', 'CREATE') THEN
                RAISE WARNING 'lockgate: queue "%" has no table (dropped outside lockgate): run lockgate.create_queue(''%'') as a role that may create tables in schema pgmq', queue, queue;
                RETURN;
            END IF;
        ELSIF NOT lockgate._made_again(queue) THEN
            RETURN;
        ELSE
            again := true;
        END IF;
        -- Adopting alters the table, which only its owner may: any other caller (a worker's
        -- start, define_job_type) leaves it, with a warning, to a migrate by the owner, and goes
        -- on with its other queues; the queue stays out of claims and sweeps until then.
        IF again AND NOT pg_has_role((SELECT c.relowner FROM pg_class c WHERE c.oid = to_regclass(format('pgmq.%I', 'q_' || queue))),
                           'USAGE') THEN
            RAISE WARNING 'lockgate: queue "%" has a table made again outside lockgate (pgmq.create), which only its owner may adopt: run lockgate migrate as that role', queue;
            RETURN;
        END IF;
    ELSIF queue ~ '_(pkey|vt_idx|msg_id_seq|lg_claim|lg_job)$' THEN
        RAISE EXCEPTION 'lockgate: invalid queue name "%"', queue
            USING ERRCODE = 'LG003',
                  DETAIL = 'a new queue''s name may not end in _pkey, _vt_idx, _msg_id_seq, _lg_claim or _lg_job: '
                           'PGMQ and lockgate give those names to the tables and indexes of the queue named without it';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('lockgate.queue:' || queue));
    -- Looked for again: a creator that held the lock may have committed it meanwhile.
    IF EXISTS (SELECT 1 FROM lockgate.queues q WHERE q.name = create_queue.queue) AND NOT lockgate._made_again(queue)
       AND to_regclass(format('pgmq.%I', 'q_' || queue)) IS NOT NULL THEN
        RETURN;
    END IF;
    -- A table of the queue's names that is not a PGMQ queue's (another application's): pgmq.create
    -- skips a table that exists, and its first index then failed on a column of its own, "vt"
    -- (review helper-77, #13).
    FOR idx IN SELECT x.tbl FROM (VALUES ('q_' || queue, ARRAY['msg_id', 'read_ct', 'enqueued_at', 'vt', 'message']),
                                         ('a_' || queue, ARRAY['msg_id', 'read_ct', 'enqueued_at', 'archived_at', 'vt', 'message'])) x(tbl, cols)
                WHERE to_regclass(format('pgmq.%I', x.tbl)) IS NOT NULL
                  AND (SELECT count(*) FROM pg_attribute a
                        WHERE a.attrelid = to_regclass(format('pgmq.%I', x.tbl)) AND a.attname = ANY (x.cols)
                          AND a.attnum > 0 AND NOT a.attisdropped) < cardinality(x.cols) LOOP
        RAISE EXCEPTION 'lockgate: queue "%" cannot be created: pgmq.% exists and is not a PGMQ queue''s table', queue, idx.tbl
            USING ERRCODE = 'LG003',
                  DETAIL = 'it lacks the columns of one (msg_id, read_ct, enqueued_at, vt, message); rename it, or give the queue another name';
    END LOOP;
    PERFORM pgmq.create(queue);
    -- Claims take the lowest priority value first, then the message visible longest, then the
    -- oldest: this index serves them, one priority at a time (sql/020_claim.sql). It replaces
    -- PGMQ's vt index, which nothing lockgate runs reads (one index to maintain, not two).
    EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON pgmq.%I ((%s), vt, msg_id)',
                   'q_' || queue || '_lg_claim', 'q_' || queue, lockgate._rank_sql('headers'));
    EXECUTE format('DROP INDEX IF EXISTS pgmq.%I', 'q_' || queue || '_vt_idx');
    -- Jobs sent again as a new message carry their id in the headers: found by it (lockgate.job).
    EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON pgmq.%I ((headers->>''job_id'')) WHERE headers ? ''job_id''',
                   'q_' || queue || '_lg_job', 'q_' || queue);
    EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON pgmq.%I ((headers->>''job_id'')) WHERE headers ? ''job_id''',
                   'a_' || queue || '_lg_job', 'a_' || queue);
    FOR idx IN SELECT x.name, x.tbl FROM (VALUES ('q_' || queue || '_lg_claim', 'q_' || queue),
                                                ('q_' || queue || '_lg_job', 'q_' || queue),
                                                ('a_' || queue || '_lg_job', 'a_' || queue)) x(name, tbl)
                WHERE NOT EXISTS (SELECT 1 FROM pg_index i
                                   WHERE i.indexrelid = to_regclass(format('pgmq.%I', x.name))
                                     AND i.indrelid = to_regclass(format('pgmq.%I', x.tbl))) LOOP
        RAISE EXCEPTION 'lockgate: queue "%" cannot be created: the name of its index pgmq.% is taken', queue, idx.name
            USING ERRCODE = 'LG003',
                  DETAIL = format('pgmq.%I is %s, not an index of pgmq.%I (the table of a PGMQ queue named %s?)', idx.name,
                                  (SELECT CASE c.relkind WHEN 'r' THEN 'a table' WHEN 'i' THEN 'an index' ELSE 'a relation' END
                                     FROM pg_class c WHERE c.oid = to_regclass(format('pgmq.%I', idx.name))),
                                  idx.tbl, substr(idx.name, 3));
    END LOOP;
    -- msg_ids come from lockgate.job_id_seq, shared by every queue: a job's id is the msg_id of
    -- its first message (migrations/0007_job_ids.sql). A PGMQ queue created before lockgate
    -- adopted it may hold messages already: the sequence moves above their ids.
    EXECUTE format('ALTER TABLE pgmq.%I ALTER COLUMN msg_id DROP IDENTITY IF EXISTS', 'q_' || queue);
    EXECUTE format('ALTER TABLE pgmq.%I ALTER COLUMN msg_id SET DEFAULT nextval(''lockgate.job_id_seq'')', 'q_' || queue);
    EXECUTE format('SELECT GREATEST((SELECT max(msg_id) FROM pgmq.%I), (SELECT max(msg_id) FROM pgmq.%I))',
                   'q_' || queue, 'a_' || queue) INTO top;
    IF top > (SELECT last_value FROM lockgate.job_id_seq) THEN
        PERFORM setval('lockgate.job_id_seq', top);
    END IF;
    -- A table made again holds only what was sent into it since with pgmq.send (no lockgate
    -- enqueue, promotion or claim reaches it before adoption), numbered by PGMQ from 1: ids that
    -- other jobs have, and that deliveries and leases of the dropped table still name. Each
    -- message takes a new id from the sequence, above every id there is; a job whose id was its
    -- msg_id (no job_id header) gets the new one.
    IF again THEN
        EXECUTE format('UPDATE pgmq.%I SET msg_id = nextval(''lockgate.job_id_seq'')', 'q_' || queue);
    END IF;
    INSERT INTO lockgate.queues (name) VALUES (queue) ON CONFLICT DO NOTHING;
    PERFORM lockgate._install_claim_steps(queue);
    PERFORM lockgate._install_enqueue_steps(queue);
    PERFORM lockgate._install_complete_steps(queue);
    PERFORM lockgate._install_promote_steps(queue);
END $$;

-- Every queue whose table was made again behind lockgate's back is adopted again by each install
-- (create_queue, above): a migrate puts it right, as it does a claim index. Nothing is made again
-- for the others. One that cannot be adopted (another relation holds one of its index names, its
-- table belongs to another role) is a warning, not a failed migrate: check_invariants goes on
-- naming it.
DO $$
DECLARE
    q text;
BEGIN
    FOR q IN SELECT x.name FROM lockgate.queues x WHERE lockgate._made_again(x.name) ORDER BY x.name LOOP
        BEGIN
            PERFORM lockgate.create_queue(q);
        EXCEPTION WHEN lock_not_available THEN
            -- A claim holding the table past the migrate's lock timeout: the migrate retries.
            RAISE;
        WHEN OTHERS THEN
            RAISE WARNING 'lockgate: queue "%", whose table was made again outside lockgate, is not adopted: %', q, SQLERRM;
        END;
    END LOOP;
END $$;

-- Pauses a queue: every claim skips it from the next statement on (running jobs finish, their
-- heartbeats and completions go on; producers still enqueue). Resuming wakes idle workers. The
-- pause is a row of lockgate.queues, so it holds for every process and across restarts. Each
-- returns whether it changed anything (false: already paused, or not paused); LG001 names an
-- unknown queue.
-- Locks: the queue's row. Callers: lockgate queue pause|resume, Client, SQL operators.
CREATE OR REPLACE FUNCTION lockgate.pause_queue(queue text)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    PERFORM lockgate._queue_table(queue, 'q');  -- LG001 for an unknown queue
    UPDATE lockgate.queues q SET paused_at = clock_timestamp() WHERE q.name = pause_queue.queue AND q.paused_at IS NULL;
    RETURN FOUND;
END $$;

CREATE OR REPLACE FUNCTION lockgate.resume_queue(queue text)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    PERFORM lockgate._queue_table(queue, 'q');
    UPDATE lockgate.queues q SET paused_at = NULL WHERE q.name = resume_queue.queue AND q.paused_at IS NOT NULL;
    IF FOUND THEN
        PERFORM pg_notify('lockgate_' || queue, '');
        RETURN true;
    END IF;
    RETURN false;
END $$;
