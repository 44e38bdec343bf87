-- What the purge records about itself (see the runtime's `expiry` module):
-- one row, written only by the purge that holds the purge lock, and read
-- by it and by `idem status`. Nothing a claim reads changes, so applying
-- this never waits for, or holds up, a claim.
CREATE TABLE idem_expiry_state (
    only_row        boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    -- The latest rotation: the generation it opened, and the id of its
    -- transaction. Its transition waits only for transactions that can
    -- still claim with a view of the state from before it, and a
    -- transaction whose snapshots are all newer than this id saw it. Used
    -- only while `rotated_gen` is the current generation: a rotation by an
    -- older runtime records nothing, and its transition then waits for
    -- every snapshot, whatever its age.
    rotated_gen     integer,
    rotated_xid     xid8,
    -- The outcome of the latest purge runs.
    last_success_at timestamptz,
    last_failure_at timestamptz,
    -- What the last failed run said (the step it failed at, and why).
    last_error      text,
    -- Runs failed in a row since the last that succeeded.
    failures        bigint      NOT NULL DEFAULT 0
);
INSERT INTO idem_expiry_state DEFAULT VALUES;
