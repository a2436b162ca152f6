-- The gauges of /metrics in one statement: what every `lockgate run` reads once per
-- metrics_interval (never once per scrape) and serves until the next read.
--   queues:    lockgate.queue_stats() with each queue's parked jobs (lockgate.parked);
--   keys:      held permits and parked jobs per concurrency key (lockgate.key_stats()), the
--              max_keys keys with the most held + parked by name, the rest summed as key 'other'
--              (a label per key would let producers grow the scrape without bound);
--   processes: rows of lockgate.processes per kind (pruned after the alive threshold).
-- Locks: none (plain reads). Callers: the runtime's metrics service, operators.
-- $1 max_keys: how many keys keep a label of their own (at least 0).
CREATE OR REPLACE FUNCTION lockgate.metrics_snapshot(max_keys integer)
RETURNS jsonb LANGUAGE sql STABLE AS $$
    WITH parked AS (
        SELECT p.queue, count(*) AS n FROM lockgate.parked p GROUP BY p.queue
    ), queues AS (
        SELECT s.queue, s.ready, s.scheduled, s.running, COALESCE(p.n, 0) AS parked, s.dead,
               s.oldest_ready_seconds, s.paused
          FROM lockgate.queue_stats() s LEFT JOIN parked p ON p.queue = s.queue
    ), ranked AS (
        SELECT k.key, k.held, k.parked,
               row_number() OVER (ORDER BY k.held + k.parked DESC, k.key) AS rank
          FROM lockgate.key_stats() k
    ), keys AS (
        SELECT CASE WHEN r.rank <= GREATEST(max_keys, 0) THEN r.key ELSE 'other' END AS key,
               sum(r.held)::bigint AS held, sum(r.parked)::bigint AS parked
          FROM ranked r
         GROUP BY 1
    ), processes AS (
        SELECT p.kind, count(*) AS count FROM lockgate.processes p GROUP BY p.kind
    )
    SELECT jsonb_build_object(
        'queues', COALESCE((SELECT jsonb_agg(to_jsonb(q) ORDER BY q.queue) FROM queues q), '[]'),
        'keys', COALESCE((SELECT jsonb_agg(to_jsonb(k) ORDER BY k.key) FROM keys k), '[]'),
        'processes', COALESCE((SELECT jsonb_agg(to_jsonb(p) ORDER BY p.kind) FROM processes p), '[]'))
$$;
