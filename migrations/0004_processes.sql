-- The process registry: one row per `lockgate run` process (kind supervisor) and one per
-- service it runs (worker pools, the dispatcher), owned by it. Heartbeats keep rows fresh;
-- any live process prunes rows silent past the alive threshold (sql/090_processes.sql).

DROP FUNCTION IF EXISTS lockgate.claim(text, integer, double precision);
-- priority becomes an integer parameter, so `priority => 1` resolves without a cast.
DROP FUNCTION IF EXISTS lockgate.define_job_type(text, text, smallint, integer, bigint, bigint, double precision, bigint, integer, text[], bigint, text);

CREATE TABLE lockgate.processes (
    id                bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY,
    kind              text NOT NULL CHECK (kind IN ('supervisor', 'worker', 'dispatcher')),
    name              text NOT NULL,
    host              text NOT NULL,
    pid               integer NOT NULL,
    supervisor_id     bigint REFERENCES lockgate.processes (id) ON DELETE CASCADE,
    started_at        timestamptz NOT NULL DEFAULT now(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT now(),
    metadata          jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object')
);
CREATE INDEX processes_supervisor_idx ON lockgate.processes (supervisor_id);
CREATE INDEX processes_heartbeat_idx ON lockgate.processes (last_heartbeat_at) WHERE kind = 'supervisor';
