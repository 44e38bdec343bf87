-- Outbox rows that keep failing do not hold up the others (src/outbox/relay.rs).
--
-- A relay used to take the oldest pending rows every cycle; when all of them
-- failed (no stream stores their subject, a stream's max_msg_size, a subject
-- the relay may not publish to, a payload above max_payload) it took the same
-- rows again, and every row queued after them waited, for every subject.
--
-- Now a row whose publish failed while NATS answered gets a back-off of its
-- own: `attempts` counts its failed publishes, `not_before` is when it may be
-- tried again, and `last_error` and `failed_at` say why and when it last
-- failed. Fresh rows (`not_before IS NULL`) are taken in id order as before;
-- failing rows are retried apart, once due, so a slow failure (a PubAck that
-- never comes) never holds up a fresh row. A failure caused by NATS itself
-- being away is not recorded on the rows: they stay fresh.
--
-- Retry them now, once the cause is fixed: `idem outbox retry`, or
--   UPDATE idem_outbox SET not_before = now(), attempts = 0
--    WHERE not_before IS NOT NULL;
ALTER TABLE idem_outbox
    ADD COLUMN attempts   integer NOT NULL DEFAULT 0,
    ADD COLUMN not_before timestamptz,
    ADD COLUMN last_error text,
    ADD COLUMN failed_at  timestamptz;

-- Fresh rows in id order, without walking past failing ones at the head.
CREATE INDEX idem_outbox_fresh ON idem_outbox (id) WHERE not_before IS NULL;

-- Failing rows by when they are due.
CREATE INDEX idem_outbox_failing ON idem_outbox (not_before, id) WHERE not_before IS NOT NULL;
