-- lockgate doctor, the database's side: every check an operator needs when something looks wrong
-- and that the database alone can answer, as rows (check_name, verdict, detail, advice) with
-- verdict 'ok', 'warn' or 'fail' and advice NULL when ok. A check that finds nothing returns one
-- 'ok' row; one that finds trouble returns a row per session or process it names, or one row
-- summing up the keys or leases it found. `lockgate doctor` adds the checks that compare the
-- database with the binary (schema version, functions checksum) and with the host (clock offset).
-- Thresholds are arguments; queue tables are reached only through lockgate._queue_table.
-- Locks: none (reads of catalogs, statistics views and lockgate's tables; never waits).
-- Callers: lockgate doctor, the dashboard, operators (`SELECT * FROM lockgate.doctor()`).
--   $1 long_running_seconds: an active transaction older than this holding locks on lockgate's
--      or PGMQ's tables is reported (warn);
--   $2 idle_in_transaction_seconds: a transaction idle for longer than this holding such locks
--      is reported (fail: it holds back the permits and parked jobs of the keys it holds, H28);
--   $3 alive_threshold_seconds: a process whose heartbeat is older than this is stale (the
--      runtime's alive_threshold, 60 s by default).

-- A duration as whole seconds, for details.
CREATE OR REPLACE FUNCTION lockgate._doctor_secs(d interval)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT round(extract(epoch FROM d))::bigint || ' s'
$$;

-- Sessions of this database, other than the caller's, whose transaction holds a lock on a table
-- of lockgate or PGMQ and is either idle for longer than idle_in_transaction or active for longer
-- than long_running. A row lock (SELECT ... FOR UPDATE on lockgate.semaphores, an enqueue not yet
-- committed) shows in pg_locks only as a RowShareLock or RowExclusiveLock on the table; with the
-- transaction idle, that is enough to name it. pg_stat_activity hides other roles' queries unless
-- the caller has pg_read_all_stats.
CREATE OR REPLACE FUNCTION lockgate._doctor_sessions(long_running interval, idle_in_transaction interval)
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH holders AS (
        SELECT a.pid, a.state, a.usename, a.application_name,
               CASE WHEN a.state = 'active' THEN now() - a.xact_start ELSE now() - a.state_change END AS how_long,
               left(regexp_replace(COALESCE(a.query, ''), '\s+', ' ', 'g'), 100) AS query,
               string_agg(DISTINCT n.nspname || '.' || c.relname, ', ') AS tables,
               (SELECT count(*) FROM pg_stat_activity w WHERE a.pid = ANY (pg_blocking_pids(w.pid))) AS blocking
          FROM pg_stat_activity a
          JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'relation' AND l.granted
                         AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
          JOIN pg_class c ON c.oid = l.relation AND c.relkind IN ('r', 'p')
          JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname IN ('lockgate', 'pgmq')
         WHERE a.pid <> pg_backend_pid() AND a.datname = current_database() AND a.backend_type = 'client backend'
           AND ((a.state LIKE 'idle in transaction%' AND a.state_change < now() - idle_in_transaction)
             OR (a.state = 'active' AND a.xact_start < now() - long_running))
         GROUP BY a.pid, a.state, a.usename, a.application_name, a.xact_start, a.state_change, a.query)
    SELECT 'sessions',
           CASE WHEN h.state = 'active' THEN 'warn' ELSE 'fail' END,
           format('pid %s (%s, application %s, role %s) %s for %s holding locks on %s, blocking %s session(s); last query: %s',
                  h.pid, h.state, COALESCE(NULLIF(h.application_name, ''), '-'), h.usename,
                  CASE WHEN h.state = 'active' THEN 'in a transaction' ELSE 'idle' END,
                  lockgate._doctor_secs(h.how_long), h.tables, h.blocking, h.query),
           CASE WHEN h.state = 'active' THEN
               format('a long transaction on lockgate''s tables delays the enqueues, completions and renewals '
                      'of the rows it holds and holds back vacuum; if it is not expected, end it: '
                      'SELECT pg_cancel_backend(%s), or pg_terminate_backend(%s)', h.pid, h.pid)
           ELSE
               format('an open transaction keeps its row locks (a key''s semaphore row, an uncommitted enqueue) '
                      'until it ends, holding back the permits of that key''s finished jobs and the jobs parked '
                      'behind them: end it in its application, or SELECT pg_terminate_backend(%s); set idle_in_transaction_session_timeout '
                      'so an abandoned transaction ends on its own', h.pid)
           END
      FROM holders h
    UNION ALL
    SELECT 'sessions', 'ok',
           format('no transaction idle over %s or active over %s holds locks on lockgate''s or PGMQ''s tables',
                  lockgate._doctor_secs(idle_in_transaction), lockgate._doctor_secs(long_running)),
           NULL
     WHERE NOT EXISTS (SELECT 1 FROM holders)
$$;

-- The timeouts a new session of this role on this database starts with, and the connection
-- headroom of the server. lockgate's runtime sets its own statement and lock budgets on its
-- connections (design §28); the database's defaults apply to producers, operators and the CLI.
CREATE OR REPLACE FUNCTION lockgate._doctor_settings()
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    SELECT 'idle_in_transaction_timeout',
           CASE WHEN s.setting = '0' THEN 'warn' ELSE 'ok' END,
           format('idle_in_transaction_session_timeout is %s for role %s on database %s',
                  CASE WHEN s.setting = '0' THEN 'off (0)' ELSE current_setting(s.name) END,
                  current_user, current_database()),
           CASE WHEN s.setting = '0' THEN
               format('an abandoned transaction holding a lockgate row (a producer that enqueued and never '
                      'committed) holds that key''s permits and parked jobs forever; set '
                      'ALTER DATABASE %I SET idle_in_transaction_session_timeout = ''5min'' (or ALTER ROLE), '
                      'longer than any transaction your producers keep open', current_database())
           END
      FROM pg_settings s WHERE s.name = 'idle_in_transaction_session_timeout'
    UNION ALL
    SELECT 'statement_timeout', 'ok',
           format('statement_timeout is %s for role %s on database %s (lockgate run sets its own budgets on '
                  'its connections; this one applies to producers, operators and the CLI)',
                  CASE WHEN s.setting = '0' THEN 'off (0)' ELSE current_setting(s.name) END,
                  current_user, current_database()),
           NULL
      FROM pg_settings s WHERE s.name = 'statement_timeout'
    UNION ALL
    -- A standby, or a database or role whose sessions start read-only, refuses every write the
    -- runtime makes (review helper-89: doctor passed one).
    SELECT 'writable',
           CASE WHEN w.standby OR w.read_only THEN 'fail' ELSE 'ok' END,
           CASE WHEN w.standby THEN 'the server is a standby (in recovery): it refuses every write lockgate makes'
                WHEN w.read_only THEN format('sessions of role %s on database %s start read-only '
                                             '(default_transaction_read_only is on, set by %s): every write lockgate makes is refused',
                                             current_user, current_database(), w.source)
                ELSE 'the server takes writes' END,
           -- Where it was set (pg_settings.source) says where to turn it off (review helper-90).
           CASE WHEN w.standby THEN 'point the database URL at the writable primary'
                WHEN NOT w.read_only THEN NULL
                WHEN w.source = 'database' THEN format('ALTER DATABASE %I RESET default_transaction_read_only', current_database())
                WHEN w.source = 'user' THEN format('ALTER ROLE %I RESET default_transaction_read_only', current_user)
                WHEN w.source = 'database user'
                    THEN format('ALTER ROLE %I IN DATABASE %I RESET default_transaction_read_only', current_user, current_database())
                WHEN w.source = 'client' THEN 'remove default_transaction_read_only from the connection''s options '
                                              '(PGOPTIONS, or options= in the database URL)'
                ELSE 'turn default_transaction_read_only off in the server''s configuration (postgresql.conf or '
                     'ALTER SYSTEM) and reload it' END
      FROM (SELECT pg_is_in_recovery() AS standby, p.setting = 'on' AS read_only, p.source
              FROM pg_settings p WHERE p.name = 'default_transaction_read_only') w
    UNION ALL
    SELECT 'connections',
           CASE WHEN c.used > 0.95 * c.usable THEN 'fail' WHEN c.used > 0.8 * c.usable THEN 'warn' ELSE 'ok' END,
           format('%s of %s connections in use (max_connections %s, less %s reserved)',
                  c.used, c.usable, c.max, c.max - c.usable),
           CASE WHEN c.used > 0.8 * c.usable THEN
               'a full server refuses new connections, and a lockgate process that cannot open one cannot '
               'claim, renew or complete; see who holds them (SELECT application_name, count(*) FROM '
               'pg_stat_activity GROUP BY 1), shrink the pools that do not need them, or raise max_connections'
           END
      -- pg_stat_database counts every role's backends; pg_stat_activity hides other roles' details.
      FROM (SELECT (SELECT sum(d.numbackends)::bigint FROM pg_stat_database d) AS used,
                   current_setting('max_connections')::integer AS max,
                   current_setting('max_connections')::integer
                     - current_setting('superuser_reserved_connections')::integer
                     -- PostgreSQL 16 reserves more for pg_use_reserved_connections; absent before.
                     - COALESCE(NULLIF(current_setting('reserved_connections', true), '')::integer, 0) AS usable) c
$$;

-- Dead tuples in PGMQ's queue and archive tables and lockgate's own (a lease or semaphore row is
-- rewritten on every renewal), and the archives' size. A table is flagged when its dead tuples
-- exceed both 10,000 and 20 % of its live ones: below either, autovacuum's defaults are keeping
-- up. An archive is flagged above 1 GiB, where backups and retention deletes start to cost.
CREATE OR REPLACE FUNCTION lockgate._doctor_tables()
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH t AS (
        SELECT s.schemaname, s.relname, s.n_live_tup, s.n_dead_tup,
               COALESCE(greatest(s.last_autovacuum, s.last_vacuum)::text, 'never') AS vacuumed,
               pg_total_relation_size(s.relid) AS bytes
          FROM pg_stat_user_tables s
         WHERE s.schemaname = 'lockgate'
            OR (s.schemaname = 'pgmq' AND (s.relname LIKE 'q\_%' OR s.relname LIKE 'a\_%'))),
    bloated AS (SELECT * FROM t WHERE t.n_dead_tup > 10000 AND t.n_dead_tup > 0.2 * t.n_live_tup),
    archives AS (SELECT * FROM t WHERE t.schemaname = 'pgmq' AND t.relname LIKE 'a\_%'),
    big AS (SELECT * FROM archives a WHERE a.bytes > 1024 * 1024 * 1024)
    SELECT 'dead_tuples', 'warn',
           format('%I.%I has %s dead tuples and %s live; last vacuumed %s', b.schemaname, b.relname,
                  b.n_dead_tup, b.n_live_tup, b.vacuumed),
           format('VACUUM (ANALYZE) %I.%I; if autovacuum does not keep up, ALTER TABLE %I.%I SET '
                  '(autovacuum_vacuum_scale_factor = 0.01); a long or idle transaction (see sessions) '
                  'holds back the cleanup of every table', b.schemaname, b.relname, b.schemaname, b.relname)
      FROM bloated b
    UNION ALL
    SELECT 'dead_tuples', 'ok',
           format('%s tables of lockgate and PGMQ queues, %s in all; none with more than 10,000 dead tuples '
                  'over 20 %% of its live ones', count(*), pg_size_pretty(COALESCE(sum(t.bytes), 0))),
           NULL
      FROM t HAVING NOT EXISTS (SELECT 1 FROM bloated)
    UNION ALL
    SELECT 'archive_size', 'warn',
           format('%I.%I holds %s (about %s rows)', g.schemaname, g.relname, pg_size_pretty(g.bytes), g.n_live_tup),
           'archived jobs are kept for archive_retention (7 days by default) by every lockgate run; lower '
           'archive_retention in [runtime] if that is more history than you need, and check that a lockgate '
           'run is up (retention runs in it) and its log shows no failed retention ticks'
      FROM big g
    UNION ALL
    SELECT 'archive_size', 'ok',
           format('%s archive table(s), %s in all (about %s rows); none above 1 GB', count(*),
                  pg_size_pretty(COALESCE(sum(a.bytes), 0)), COALESCE(sum(a.n_live_tup), 0)),
           NULL
      FROM archives a HAVING NOT EXISTS (SELECT 1 FROM big)
$$;

-- Leases whose message no longer exists in its queue (removed outside lockgate: pgmq.delete,
-- pgmq.archive, pgmq.purge_queue), or whose queue is gone; not the live lease of a job cancelled
-- while it ran, which its worker gives back once the handler stopped (sql/045_cancel.sql), nor
-- the lease of a job that finished while another transaction held its key's row, which the
-- sweep frees once the row is free (finished_at, sql/015_concurrency.sql). Their permits are counted as held
-- until the sweep frees them, which it does once they expire (their holder may still run until
-- then, sql/080_sweep.sql). One row for all of them. Then the backends that run an `sql` job's
-- statement for a job their delivery no longer holds (held_statements, below).
DROP FUNCTION IF EXISTS lockgate._doctor_leases();
CREATE OR REPLACE FUNCTION lockgate._doctor_leases(long_running interval DEFAULT interval '60 seconds')
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    q record;
    n bigint;
    expired bigint;
    found_n bigint := 0;
    found_expired bigint := 0;
    places text[] := '{}';
    oldest timestamptz;
    b record;
    why text;
BEGIN
    check_name := 'orphaned_leases';
    FOR q IN SELECT DISTINCT l.queue FROM lockgate.leases l ORDER BY 1 LOOP
        IF q.queue IN (SELECT lockgate._live_queues()) THEN
            EXECUTE format(
                'SELECT count(*), count(*) FILTER (WHERE l.expires_at < now()) FROM lockgate.leases l
                  WHERE l.queue = $1 AND l.finished_at IS NULL
                    AND NOT EXISTS (SELECT 1 FROM %s m WHERE m.msg_id = l.msg_id)
                    -- A cancelled running job keeps its lease until its handler stopped: expected.
                    AND NOT (l.expires_at >= now()
                             AND EXISTS (SELECT 1 FROM %s x WHERE x.msg_id = l.msg_id
                                                             AND x.headers->>''cancelled_in'' = ''running''))',
                lockgate._queue_table(q.queue, 'q'), lockgate._queue_table(q.queue, 'a'))
               INTO n, expired USING q.queue;
        ELSE
            SELECT count(*), count(*) FILTER (WHERE l.expires_at < now()) INTO n, expired
              FROM lockgate.leases l WHERE l.queue = q.queue;
        END IF;
        IF n > 0 THEN
            found_n := found_n + n;
            found_expired := found_expired + expired;
            places := places || format('%s on queue %s', n, q.queue);
        END IF;
    END LOOP;
    IF found_n = 0 THEN
        verdict := 'ok';
        detail := 'every lease belongs to a message in its queue';
        advice := NULL;
    ELSE
        verdict := 'warn';
        detail := format('%s lease(s) whose message is gone (%s), %s of them expired; each counts as a held '
                         'permit until it is freed', found_n, array_to_string(places, ', '), found_expired);
        advice := 'the sweep frees such a lease once it expires, within sweep_interval (5 s by default); '
                  'if expired ones stay, no sweep is running: start lockgate run, or SELECT * FROM '
                  'lockgate.sweep(). Remove messages through lockgate (dlq purge, parked discard), not '
                  'with pgmq.delete or pgmq.archive';
    END IF;
    RETURN NEXT;
    -- The permits of jobs that finished while another transaction held their key's row: the next
    -- completion or enqueue of the key, or the sweep, gives each back once the row is free
    -- (sql/015_concurrency.sql, lockgate._release_leases); one older than a minute means none of
    -- them has held the row since.
    check_name := 'finished_leases';
    SELECT count(*), min(l.finished_at) INTO n, oldest FROM lockgate.leases l
     WHERE l.finished_at < now() - interval '1 minute';
    IF n = 0 THEN
        verdict := 'ok';
        detail := 'no finished job has held its permit for over a minute';
        advice := NULL;
    ELSE
        verdict := 'warn';
        detail := format('%s permit(s) of finished jobs not given back, the oldest finished %s ago: each counts as '
                         'held, and its key''s parked jobs wait', n, date_trunc('second', now() - oldest));
        advice := 'a finished job''s permit goes back once its key''s row is free: at the next sweep (sweep_interval, 5 s '
                  'by default) or the next completion or enqueue of the key. If they stay, no sweep is running (start '
                  'lockgate run, or SELECT * FROM lockgate.sweep()) or a transaction holds the key''s row (see the '
                  'sessions check)';
    END IF;
    RETURN NEXT;
    -- Statements of `sql` jobs (or sessions still carrying their mark) that run on after their
    -- job left their delivery: its visibility ran out over 10 s ago, it was put back (a claim
    -- found the statement running and could not end it), or it is no longer in its queue
    -- (completed, cancelled, dead-lettered) and the backend has been in its state for longer than
    -- long_running (a live executor stops its statement at once when its job is cancelled, and
    -- clears the mark before it completes the job). Whatever takes such a job ends the
    -- backend first, and keeps the job, its permit or its unique key while it cannot
    -- (docs/design.md §100): one that stays here is one lockgate's role may not end, or one whose
    -- job nothing has taken yet (its lockgate frozen or cut off). Marks as
    -- lockgate._statement_marks counts them: this database's, of roles that may renew leases.
    check_name := 'held_statements';
    places := '{}';
    FOR b IN WITH marked AS MATERIALIZED (
                 -- The id only of a mark that can be one (any role may set any application_name).
                 SELECT a.pid, a.usesysid, a.application_name AS tag, a.state_change,
                        CASE WHEN split_part(a.application_name, ' ', 3)::numeric <= 9223372036854775807
                             THEN split_part(a.application_name, ' ', 3)::bigint END AS msg_id
                   FROM pg_stat_get_activity(NULL::integer) a
                  WHERE a.application_name ~ '^lockgate job [0-9]{1,19} ' AND a.pid <> pg_backend_pid()
                    AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
                    AND has_table_privilege(a.usesysid, 'lockgate.leases', 'UPDATE'))
             SELECT m.pid, COALESCE(r.rolname::text, '?') AS role, m.state_change, m.msg_id, lq.name AS queue
               FROM marked m
               JOIN lockgate._live_queues() lq(name) ON lockgate._statement_tag(lq.name, m.msg_id) = m.tag
               LEFT JOIN pg_roles r ON r.oid = m.usesysid
              ORDER BY m.pid LOOP
        EXECUTE format(
            'SELECT CASE WHEN m.msg_id IS NULL THEN CASE WHEN $2 <= now() - $3 THEN ''no longer in its queue'' END
                         WHEN m.headers->''retry_at'' = m.headers->''put_back_until'' THEN ''put back until it ends''
                         WHEN m.vt < now() - interval ''10 seconds''
                         THEN ''its delivery lapsed '' || lockgate._doctor_secs(now() - m.vt) || '' ago''
                    END
               FROM (SELECT 1) o LEFT JOIN %s m ON m.msg_id = $1',
            lockgate._queue_table(b.queue, 'q'))
          INTO why USING b.msg_id, b.state_change, long_running;
        IF why IS NOT NULL THEN
            places := places || format('backend %s of role %s (job %s of queue %s: %s)', b.pid, b.role, b.msg_id,
                                       b.queue, why);
        END IF;
    END LOOP;
    IF cardinality(places) = 0 THEN
        verdict := 'ok';
        detail := 'no sql statement runs on for a job its delivery no longer holds';
        advice := NULL;
    ELSE
        verdict := 'warn';
        detail := format('%s backend(s) run a job''s sql statement, or carry its mark, after the job left their '
                         'delivery: %s', cardinality(places), array_to_string(places, '; '));
        advice := 'the sweep, the claim, cancel and the unique-key reaper end such a backend before they hand its job, '
                  'permit or key on, and keep them while they cannot: lockgate''s role may not terminate it (only a '
                  'superuser may end a superuser''s backend; another role''s needs pg_signal_backend and EXECUTE on '
                  'pg_terminate_backend), or nothing has taken the job yet. End it as a role that may (SELECT '
                  'pg_terminate_backend(pid)); to keep it from happening, run lockgate''s sql jobs and its sweep as '
                  'the same role';
    END IF;
    RETURN NEXT;
END $$;

-- Keys with parked jobs and room for the next of them now: what the sweep promotes (no
-- semaphore row, the next job's type gone or no longer limited, or fewer permits held than the
-- least of that type's current limit and, on a key types share, its holders' types' limits:
-- lockgate._parked_keys_to_judge and lockgate._next_parked_room, the sweep's own judgement). Seen
-- for a moment after a holder's lease is freed, or for one round of the sweep's repair when no
-- release touched the key; one that stays means no sweep runs. One row for all of them.
CREATE OR REPLACE FUNCTION lockgate._doctor_parked()
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH roomy AS (
        SELECT m.key, m.oldest, r.held, r.lim
          FROM lockgate._parked_keys_to_judge() m CROSS JOIN LATERAL lockgate._next_parked_room(m.key) r
         WHERE r.room),
    listed AS (
        SELECT y.*, (SELECT count(*) FROM lockgate.parked p WHERE p.key = y.key) AS parked
          FROM (SELECT * FROM roomy ORDER BY oldest LIMIT 5) y)
    SELECT 'parked_with_room', 'warn',
           format('%s key(s) have parked jobs and a free permit: %s%s', (SELECT count(*) FROM roomy),
                  (SELECT string_agg(format('%s (%s parked, %s of %s held, oldest parked %s ago)', l.key, l.parked,
                                            l.held, COALESCE(l.lim::text, 'no limit'),
                                            lockgate._doctor_secs(now() - l.oldest)), '; ' ORDER BY l.oldest)
                     FROM listed l),
                  CASE WHEN (SELECT count(*) FROM roomy) > 5 THEN '; …' ELSE '' END),
           'the sweep promotes them within sweep_interval (5 s by default), or within one round of its repair '
           '(a pass per 256 keys with parked jobs) when no release touched them; if they stay, no sweep is running: '
           'start lockgate run (or check its log for failed sweep ticks), or SELECT * FROM lockgate.sweep()'
     WHERE EXISTS (SELECT 1 FROM roomy)
    UNION ALL
    SELECT 'parked_with_room', 'ok', 'no key has parked jobs and a free permit', NULL
     WHERE NOT EXISTS (SELECT 1 FROM roomy)
$$;

-- Keys with parked jobs whose parked jobs and holders are of types with different limits: types
-- that name one explicit concurrency key (README, Concurrency limits; design §105, §109; the
-- holders too since review helper-124 F4: a looser type's job parked behind a stricter type's
-- holder is the common case of such a wait). Each job is admitted under the
-- strictest limit among the key's holders, so a job of the stricter type starts only once fewer
-- than its limit hold permits, and promotion, which takes a key's parked jobs in order, stops at
-- it, while the looser type's enqueues take free permits directly: the parked jobs may wait as
-- long as that traffic lasts. One read of the parked jobs, and of the leases of their keys; one
-- row for all such keys.
CREATE OR REPLACE FUNCTION lockgate._doctor_shared_keys()
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH waiting AS (
        SELECT p.key, count(*) AS parked FROM lockgate.parked p GROUP BY p.key),
    -- The types of each such key's parked jobs and of its holders (their leases).
    typed AS (
        SELECT p.key, p.job_type FROM lockgate.parked p
        UNION
        SELECT l.key, l.job_type FROM lockgate.leases l JOIN waiting w ON w.key = l.key),
    mixed AS (
        SELECT w.key, w.parked,
               string_agg(format('%s limited to %s', jt.name, jt.concurrency_limit), ', ' ORDER BY jt.name) AS types
          FROM waiting w
          JOIN typed x ON x.key = w.key
          JOIN lockgate.job_types jt ON jt.name = x.job_type AND jt.concurrency_limit IS NOT NULL
         GROUP BY w.key, w.parked
        HAVING min(jt.concurrency_limit) <> max(jt.concurrency_limit)),
    listed AS (SELECT * FROM mixed ORDER BY key LIMIT 5)
    SELECT 'shared_keys', 'warn',
           format('%s key(s) have parked jobs, and parked jobs or holders of types with different limits: %s%s',
                  (SELECT count(*) FROM mixed),
                  (SELECT string_agg(format('%s (%s parked: %s)', l.key, l.parked, l.types), '; ' ORDER BY l.key)
                     FROM listed l),
                  CASE WHEN (SELECT count(*) FROM mixed) > 5 THEN '; …' ELSE '' END),
           'types that name one concurrency key share its permits, each job admitted under the strictest limit among '
           'the key''s holders: a job of the stricter type waits for fewer holders than its limit, holding back the '
           'jobs parked behind it, while the looser type''s enqueues take free permits directly, for as long as that '
           'traffic lasts. If that wait matters, give the types one limit (lockgate.define_job_type) or keys of their own'
     WHERE EXISTS (SELECT 1 FROM mixed)
    UNION ALL
    SELECT 'shared_keys', 'ok', 'no key has parked jobs, and parked jobs or holders of types with different limits', NULL
     WHERE NOT EXISTS (SELECT 1 FROM mixed)
$$;

-- Live processes (heard from within alive_threshold) of a build older than the database's
-- functions: one that records a lower functions revision in its metadata, or none (every build
-- before revision 115). The older build's own paths run beside the newer ones, so a guarantee
-- added since holds only for the jobs the newer processes run (review helper-118: an older `sql`
-- executor's statement carries no mark, so the fence of design §100 cannot end it, and a build
-- older still does not even cancel it when its job is cancelled or returned). One row per such
-- process, or one ok row.
CREATE OR REPLACE FUNCTION lockgate._doctor_builds(alive_threshold interval)
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH current AS (SELECT s.functions_revision AS revision FROM lockgate.schema_state s),
    older AS (
        SELECT p.id, p.name, p.host, p.pid, p.metadata->>'functions_revision' AS recorded,
               CASE WHEN p.metadata->>'functions_revision' ~ '^[0-9]{1,9}$'
                    THEN (p.metadata->>'functions_revision')::integer END AS revision
          FROM lockgate.processes p
         WHERE p.kind = 'supervisor' AND p.last_heartbeat_at >= now() - alive_threshold)
    SELECT 'process_builds', 'warn',
           format('process %s (%s on %s, pid %s) runs an older build than the database''s functions (revision %s): %s',
                  o.id, o.name, o.host, o.pid, COALESCE(c.revision::text, 'not recorded'),
                  CASE WHEN o.revision IS NOT NULL THEN 'revision ' || o.revision
                       WHEN o.recorded IS NULL THEN 'a build that records no revision (before 115)'
                       ELSE format('a revision that is not one (%s)', left(o.recorded, 40)) END),
           'a rolling deploy is under way, or this process was left behind: replace it with the current build. '
           'Until it is replaced, what later builds added holds only for the jobs the newer processes run '
           '(README: rolling deploys); an older sql executor''s statement, for one, cannot be ended by the newer '
           'processes when its job is taken from it'
      FROM older o, current c
     WHERE o.revision IS NULL OR o.revision < c.revision
    UNION ALL
    SELECT 'process_builds', 'ok',
           format('every live process runs the database''s functions revision (%s)',
                  COALESCE(c.revision::text, 'not recorded')), NULL
      FROM current c
     WHERE NOT EXISTS (SELECT 1 FROM older o WHERE o.revision IS NULL OR o.revision < c.revision)
$$;

-- Supervisors whose last heartbeat is older than the alive threshold. Any live process prunes
-- them at its next process heartbeat; one that stays means no live process is registered.
CREATE OR REPLACE FUNCTION lockgate._doctor_processes(alive_threshold interval)
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH stale AS (
        SELECT p.* FROM lockgate.processes p
         WHERE p.kind = 'supervisor' AND p.last_heartbeat_at < now() - alive_threshold)
    SELECT 'stale_processes', 'warn',
           format('process %s (%s on %s, pid %s) last heartbeat %s ago, past the alive threshold of %s',
                  s.id, s.name, s.host, s.pid, lockgate._doctor_secs(now() - s.last_heartbeat_at),
                  lockgate._doctor_secs(alive_threshold)),
           format('it stopped, or cannot reach the database; a live lockgate run prunes it at its next '
                  'process heartbeat (its jobs come back when their visibility lapses); if it stays, no '
                  'lockgate run is up. DELETE FROM lockgate.processes WHERE id = %s removes it by hand', s.id)
      FROM stale s
    UNION ALL
    SELECT 'stale_processes', 'ok',
           format('%s process(es) registered, every one heard from within %s',
                  (SELECT count(*) FROM lockgate.processes p WHERE p.kind = 'supervisor'),
                  lockgate._doctor_secs(alive_threshold)),
           NULL
     WHERE NOT EXISTS (SELECT 1 FROM stale)
    UNION ALL
    SELECT * FROM lockgate._doctor_builds(alive_threshold)
$$;

-- Queues whose generated steps (lockgate._steps(): the claim step, sql/020_claim.sql; the
-- enqueue steps, sql/010_enqueue.sql; the promotion step, sql/015_concurrency.sql; the
-- completion step, sql/040_complete.sql) are not as lockgate writes them: missing (dropped by
-- hand, or the queue's table was missing at the last migrate), more than one function under a
-- step's name (an overload some role added), another owner than its installer's, or other
-- argument types. Enqueues, completions, promotions and claims run no such step
-- (lockgate._trusted_step): an enqueue, a completion or a promotion plans its statements at every
-- call instead (slower, never wrong), a claim writes its step again, or fails when its installer
-- may not replace another role's function. Not seen here: a step whose EXECUTE a role lacks
-- (that role's enqueues take the slower path; grant EXECUTE on the steps). One lookup by name
-- per step; one row per step, or one ok row.
CREATE OR REPLACE FUNCTION lockgate._doctor_steps()
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH expected AS (
        SELECT q.queue, s.prefix || q.queue AS name, s.args,
               (SELECT x.proowner FROM pg_catalog.pg_proc x WHERE x.oid = s.installer::regprocedure) AS owner
          FROM lockgate._live_queues() q(queue)
         CROSS JOIN lockgate._steps() s),
    wrong AS (
        SELECT e.queue, e.name,
               CASE WHEN f.n = 0 THEN 'missing'
                    WHEN f.n > 1 THEN format('one of %s functions under its name', f.n)
                    WHEN f.owner <> e.owner
                        THEN format('owned by %s, not by its installer''s owner %s', f.owner::regrole, e.owner::regrole)
                    WHEN f.argtypes <> array_to_string(e.args::oid[], ' ')::oidvector
                        THEN format('of other arguments (%s)', oidvectortypes(f.argtypes))
               END AS why
          FROM expected e
         CROSS JOIN LATERAL (SELECT count(*) AS n, min(p.proowner::bigint)::oid AS owner,
                                    min(p.proargtypes::text)::oidvector AS argtypes
                               FROM pg_catalog.pg_proc p
                              WHERE p.proname = e.name::name AND p.pronamespace = 'lockgate'::regnamespace) f)
    SELECT 'queue_steps', 'warn', format('queue %s: lockgate.%s is %s', w.queue, w.name, w.why),
           'run lockgate migrate as the role that installed lockgate (or a superuser), which writes every queue''s '
           'steps again and drops other functions under their names; until then the queue''s enqueues, '
           'completions and promotions plan their statements at every call, and its claims write the claim step again'
      FROM wrong w WHERE w.why IS NOT NULL
    UNION ALL
    SELECT 'queue_steps', 'ok', format('%s queue(s), each with its claim, enqueue, completion and promotion steps as lockgate writes them',
                                       (SELECT count(*) FROM lockgate._live_queues())), NULL
     WHERE NOT EXISTS (SELECT 1 FROM wrong w WHERE w.why IS NOT NULL)
$$;

-- Each queue's claim index, against the one lockgate.create_queue builds now
-- (lockgate._stale_claim_indexes, read once): every install of the functions builds again one
-- that is missing, not valid or of another definition, but one dropped, rebuilt by hand or left
-- invalid by a failed build between installs makes every claim of its queue read the whole queue.
-- One row per such queue, or one row when the reference index is missing, or one ok row. A queue
-- whose index name another relation holds (a queue named <queue>_lg_claim, made before such names
-- were refused) gets no index from any install: its row says which, and what to do.
CREATE OR REPLACE FUNCTION lockgate._doctor_claim_indexes()
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH probe AS (
        SELECT to_regclass('lockgate.claim_index_probe_rank') IS NOT NULL AS present),
    stale AS MATERIALIZED (
        SELECT s.* FROM lockgate._stale_claim_indexes() s WHERE (SELECT present FROM probe))
    SELECT 'claim_indexes', 'warn',
           'lockgate.claim_index_probe_rank, the index each queue''s claim index is compared with, is missing',
           'run lockgate migrate, which builds it again and every claim index that differs from it'
     WHERE NOT (SELECT present FROM probe)
    UNION ALL
    SELECT 'claim_indexes', 'warn',
           CASE WHEN s.taken_by IS NULL
                THEN format('queue %s: its claim index pgmq.%I is %s', s.queue, 'q_' || s.queue || '_lg_claim', s.why)
                ELSE format('queue %s has no claim index: its name is taken by %s', s.queue, s.taken_by) END,
           CASE WHEN s.taken_by IS NULL
                THEN 'every claim of this queue reads the whole queue until its index is right; run lockgate migrate, '
                     'which builds it again, locking the queue''s table while it builds'
                ELSE format('every claim of queue %s reads the whole queue, and no migrate builds an index under a name '
                            'another relation holds: move the work of queue %s, or of the queue whose table holds the '
                            'name, to a queue of another name, drain the old one and drop it (pgmq.drop_queue)',
                            s.queue, s.queue) END
      FROM stale s
    UNION ALL
    SELECT 'claim_indexes', 'ok', format('%s queue(s), each with the claim index lockgate builds',
                                         (SELECT count(*) FROM lockgate._live_queues())), NULL
     WHERE (SELECT present FROM probe) AND NOT EXISTS (SELECT 1 FROM stale)
$$;

-- Migrations 19 and 20's guards of the key tables (docs/design.md §61): present and enabled. A
-- trigger disabled (ALTER TABLE ... DISABLE TRIGGER, or a replica-only setting) or dropped by hand
-- lets the hand edits they refuse through: a key row deleted or renamed while leases count by it,
-- a lease moved to another key. One row per trigger not as migrate left it, or one ok row.
CREATE OR REPLACE FUNCTION lockgate._doctor_key_guards()
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH expected(tbl, name, migration) AS (
        VALUES ('semaphores', 'semaphores_still_counted', '0019_key_row_guards.sql'),
               ('semaphores', 'semaphores_not_truncated', '0019_key_row_guards.sql'),
               ('semaphores', 'semaphores_key_not_renamed', '0020_key_changes_refused.sql'),
               ('leases', 'leases_key_not_moved', '0020_key_changes_refused.sql')),
    wrong AS (
        SELECT e.tbl, e.name, e.migration, t.tgenabled
          FROM expected e
          LEFT JOIN pg_catalog.pg_trigger t
            ON t.tgrelid = to_regclass('lockgate.' || e.tbl) AND t.tgname = e.name::name
         WHERE t.tgenabled IS DISTINCT FROM 'O' AND t.tgenabled IS DISTINCT FROM 'A')
    SELECT 'key_guards', 'warn',
           format('trigger %s on lockgate.%s is %s', w.name, w.tbl,
                  CASE WHEN w.tgenabled IS NULL THEN 'missing' ELSE 'disabled' END),
           CASE WHEN w.tgenabled IS NULL
                THEN format('create it again as migrations/%s does; until then lockgate does not refuse the hand edit it guards '
                            '(SELECT * FROM lockgate.check_invariants() names a key whose permits no longer match its leases)', w.migration)
                ELSE format('ALTER TABLE lockgate.%s ENABLE TRIGGER %s; until then lockgate does not refuse the hand edit it guards',
                            w.tbl, w.name) END
      FROM wrong w
    UNION ALL
    SELECT 'key_guards', 'ok', 'the key tables'' guards (migrations 19 and 20) are in place and enabled', NULL
     WHERE NOT EXISTS (SELECT 1 FROM wrong)
$$;

-- Roles other than the owner that may write the tables holding permits, leases, parked jobs,
-- unique locks and batches: a producer's role needs none of that since revision 82 (its
-- functions run as the owner; docs/design.md §83), and a role that has it can change a permit by
-- hand, which lockgate cannot tell from its own writes. One warn row per such role (PUBLIC
-- included), or one ok row; grants on the tables and on their columns (GRANT UPDATE (value) is
-- enough to free a permit; review helper-86) alike. Direct grants only: members of the owning
-- role are the owner. The REVOKE given cascades to the grants the role passed on.
CREATE OR REPLACE FUNCTION lockgate._doctor_table_writers()
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH writes AS (
        SELECT c.relname, a.grantee
          FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
         WHERE c.relnamespace = 'lockgate'::regnamespace
           AND c.relname IN ('semaphores', 'leases', 'parked', 'unique_locks', 'batches', 'batch_jobs')
           AND a.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE') AND a.grantee <> c.relowner
        UNION ALL
        SELECT c.relname, a.grantee
          FROM pg_catalog.pg_class c
          JOIN pg_catalog.pg_attribute t ON t.attrelid = c.oid AND t.attacl IS NOT NULL
          CROSS JOIN LATERAL pg_catalog.aclexplode(t.attacl) a
         WHERE c.relnamespace = 'lockgate'::regnamespace
           AND c.relname IN ('semaphores', 'leases', 'parked', 'unique_locks', 'batches', 'batch_jobs')
           AND a.privilege_type IN ('INSERT', 'UPDATE') AND a.grantee <> c.relowner),
    w AS (
        SELECT CASE WHEN x.grantee = 0 THEN 'PUBLIC' ELSE x.grantee::regrole::text END AS grantee,
               string_agg(DISTINCT 'lockgate.' || x.relname, ', ') AS tables
          FROM writes x
         GROUP BY 1)
    SELECT 'table_writers', 'warn',
           format('%s may write %s: it can change permits, leases and parked jobs by hand', w.grantee, w.tables),
           format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON %s FROM %s CASCADE, unless lockgate run runs as it (a column '
                  'grant goes with the table''s REVOKE); a producer''s role needs only the grants of the README''s "A '
                  'producer''s role"', w.tables, w.grantee)
      FROM w
    UNION ALL
    SELECT 'table_writers', 'ok', 'only the owner may write lockgate''s permit, lease, parked-job, unique-lock and batch tables', NULL
     WHERE NOT EXISTS (SELECT 1 FROM w)
$$;

-- Whether this role can see other roles' sessions (a superuser, or a member of
-- pg_read_all_stats): without it the sessions check is blind to them. One warn row, or none.
CREATE OR REPLACE FUNCTION lockgate._doctor_visibility()
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    SELECT 'sessions', 'warn',
           format('role %s cannot see other roles'' sessions: a transaction of another role holding '
                  'lockgate''s rows would not be named here', current_user),
           'run lockgate doctor as a superuser, or GRANT pg_read_all_stats TO ' || quote_ident(current_user)
     WHERE NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
       AND NOT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')
$$;

-- Queues whose PGMQ table is gone (dropped outside lockgate, pgmq.drop_queue) or was made again
-- outside lockgate (pgmq.create after it): claims, sweeps, status and retention pass them by, so
-- their jobs neither run nor fail, and only this and check_invariants say so. One row.
CREATE OR REPLACE FUNCTION lockgate._doctor_queue_tables()
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH bad AS (
        SELECT q.name, lockgate._made_again(q.name) AS again
          FROM lockgate.queues q WHERE q.name NOT IN (SELECT lockgate._live_queues()))
    SELECT 'queue_tables', 'fail',
           string_agg(format('queue %s: %s', b.name,
                             CASE WHEN b.again THEN 'its table was made again outside lockgate (pgmq.create): no claim '
                                                    'takes its messages until lockgate adopts it'
                                  ELSE 'its table was dropped outside lockgate (pgmq.drop_queue)' END), '; '
                      ORDER BY b.name),
           'a table made again: run lockgate migrate as the role that owns it, which adopts it (its messages take '
           'lockgate''s ids). A table dropped: create the queue again (lockgate.create_queue) if its parked jobs and '
           'dead letters should run, or retire it: lockgate queue drop (lockgate.drop_queue) names what still refers to it'
      FROM bad b HAVING count(*) > 0
    UNION ALL
    SELECT 'queue_tables', 'ok', format('%s queue(s), each with its PGMQ table as lockgate made or adopted it', count(*)), NULL
      FROM lockgate.queues q HAVING NOT EXISTS (SELECT 1 FROM lockgate.queues x WHERE x.name NOT IN (SELECT lockgate._live_queues()))
$$;

-- Queues with jobs ready for longer than alive_threshold that no live lockgate process serves
-- (no worker of a supervisor heard from within alive_threshold names them), and not paused: their
-- jobs wait for good. The usual cause is a job type moved to another queue while jobs of it were
-- queued (they stay in the queue they were enqueued into) and no pool left on the old one
-- (review helper-136 F10: nothing said so). One row per such queue, or one ok row.
CREATE OR REPLACE FUNCTION lockgate._doctor_unserved(alive_threshold interval)
RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE sql STABLE AS $$
    WITH served AS (
        SELECT DISTINCT x.queue
          FROM lockgate.processes w
          JOIN lockgate.processes s ON s.id = w.supervisor_id AND s.last_heartbeat_at >= now() - alive_threshold
         CROSS JOIN LATERAL jsonb_array_elements_text(
                   CASE WHEN jsonb_typeof(w.metadata->'queues') = 'array' THEN w.metadata->'queues' ELSE '[]' END) x(queue)
         WHERE w.kind = 'worker'),
    waiting AS (
        SELECT st.queue, st.ready, st.oldest_ready_seconds
          FROM lockgate.queue_stats() st
         WHERE st.ready > 0 AND NOT st.paused AND st.oldest_ready_seconds > extract(epoch FROM alive_threshold)
           AND st.queue NOT IN (SELECT served.queue FROM served))
    SELECT 'unserved_queues', 'warn',
           format('queue %s: %s job(s) ready, the oldest for %s, and no live lockgate process serves it (job types '
                  'defined on it now: %s)',
                  w.queue, w.ready, lockgate._doctor_secs(make_interval(secs => w.oldest_ready_seconds)),
                  COALESCE((SELECT string_agg(t.name, ', ' ORDER BY t.name) FROM lockgate.job_types t
                             WHERE t.queue = w.queue), 'none')),
           format('start a pool on queue %s (a [[pool]] whose queues include it), or pause it (lockgate queue pause) '
                  'if it waits on purpose. A job stays in the queue it was enqueued into when its type moves to '
                  'another: serve the old queue until it drains', w.queue)
      FROM waiting w
    UNION ALL
    SELECT 'unserved_queues', 'ok', 'every queue with jobs ready is served by a live process, or paused', NULL
     WHERE NOT EXISTS (SELECT 1 FROM waiting)
$$;

-- The entry point (its contract is at the top of this file). Thresholds must be finite and
-- not negative (LG003).
CREATE OR REPLACE FUNCTION lockgate.doctor(
    long_running_seconds double precision DEFAULT 60,
    idle_in_transaction_seconds double precision DEFAULT 10,
    alive_threshold_seconds double precision DEFAULT 60
) RETURNS TABLE (check_name text, verdict text, detail text, advice text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t double precision;
BEGIN
    FOREACH t IN ARRAY ARRAY[long_running_seconds, idle_in_transaction_seconds, alive_threshold_seconds] LOOP
        IF t IS NULL OR t < 0 OR t IN ('infinity', 'NaN') THEN
            RAISE EXCEPTION 'lockgate: invalid doctor threshold % seconds: a finite number, 0 or more', t
                USING ERRCODE = 'LG003';
        END IF;
    END LOOP;
    RETURN QUERY
        SELECT * FROM lockgate._doctor_visibility()
        UNION ALL SELECT * FROM lockgate._doctor_sessions(make_interval(secs => long_running_seconds),
                                                          make_interval(secs => idle_in_transaction_seconds))
        UNION ALL SELECT * FROM lockgate._doctor_settings()
        UNION ALL SELECT * FROM lockgate._doctor_tables()
        UNION ALL SELECT * FROM lockgate._doctor_leases(make_interval(secs => long_running_seconds))
        UNION ALL SELECT * FROM lockgate._doctor_parked()
        UNION ALL SELECT * FROM lockgate._doctor_shared_keys()
        UNION ALL SELECT * FROM lockgate._doctor_processes(make_interval(secs => alive_threshold_seconds));
    -- These four read the queues' relations in schema pgmq, which a role without USAGE on it may
    -- not even name: each says it was not checked, and the others still answer.
    IF has_schema_privilege('pgmq', 'USAGE') THEN
        RETURN QUERY SELECT * FROM lockgate._doctor_queue_tables() UNION ALL SELECT * FROM lockgate._doctor_steps()
                     UNION ALL SELECT * FROM lockgate._doctor_claim_indexes()
                     UNION ALL SELECT * FROM lockgate._doctor_unserved(make_interval(secs => alive_threshold_seconds));
    ELSE
        RETURN QUERY
            SELECT c, 'warn',
                   format('not checked: role %s has no USAGE on schema pgmq, where the queues'' tables are', current_user),
                   format('run lockgate doctor as the role lockgate runs as, or GRANT USAGE ON SCHEMA pgmq TO %I', current_user)
              FROM unnest(ARRAY['queue_tables', 'queue_steps', 'claim_indexes', 'unserved_queues']) c;
    END IF;
    RETURN QUERY SELECT * FROM lockgate._doctor_key_guards() UNION ALL SELECT * FROM lockgate._doctor_table_writers();
END $$;
