-- The claim becomes one statement that the runtime prepares per session
-- (`CLAIM_SQL` in the runtime's claim module), in place of the function
-- `idem_claim`: inside a PL/pgSQL function each of its statements was
-- planned again on every call (the planner prefers custom plans for a
-- partitioned table), which cost more than the claim's own work. The
-- protocol is unchanged (see 0002_claims_by_generation.sql).
DROP FUNCTION idem_claim(integer, uuid);

-- The claim joins this one-row table; without statistics the planner
-- guesses a thousand rows and plans the claim badly. Its row count never
-- changes, so once is enough.
ANALYZE idem_dedup_state;
ANALYZE idem_generations;
