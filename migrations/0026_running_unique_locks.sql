-- The while_executing locks of runs under way (not kept for a cancelled handler), which the sweep
-- looks at for runs whose delivery lapsed (lockgate._release_lapsed_runs, docs/design.md §108):
-- as many entries as such runs, so a pass costs a probe per run under way however many
-- until_executed locks the table holds.
CREATE INDEX unique_locks_running_idx ON lockgate.unique_locks (queue, msg_id)
 WHERE mode = 'while_executing' AND held_until IS NULL;
