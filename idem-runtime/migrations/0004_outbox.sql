-- The transactional outbox (src/outbox.rs).
--
-- A handler (or any transaction) queues a message by inserting a row here;
-- the row commits or rolls back with the transaction's other writes. A relay
-- (outbox::Relay) takes committed rows in id order with FOR UPDATE SKIP
-- LOCKED, publishes each to JetStream with msg_id as its Nats-Msg-Id, and
-- deletes the rows whose PubAck came back, in the same transaction that
-- locked them. Sent rows are deleted, not marked: the table holds only what
-- is pending, so it stays small and needs no cleanup job (JetStream's stream
-- is the record of what was sent).
CREATE TABLE idem_outbox (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The message's Nats-Msg-Id. Unique among pending rows: a second row
    -- with the same id would be dropped by JetStream's publish dedup anyway,
    -- so outbox::send inserts with ON CONFLICT DO NOTHING.
    msg_id     text        NOT NULL,
    subject    text        NOT NULL,
    payload    bytea       NOT NULL,
    -- The message's other headers, as a JSON array of [name, value] pairs
    -- (a header may repeat), or NULL.
    headers    jsonb,
    -- The queuing transaction's start, for the relay's lag.
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT idem_outbox_msg_id_key UNIQUE (msg_id)
);

-- Wakes relays that LISTEN on `idem_outbox`. One notification per inserting
-- statement, and PostgreSQL folds identical notifications of one
-- transaction into one, so a transaction that queues many messages notifies
-- once. A notifying transaction takes a cluster-wide lock on the
-- notification queue at COMMIT, which serialises the commits of queuing
-- transactions (not of others). Where that costs more than it saves,
-- `ALTER TABLE idem_outbox DISABLE TRIGGER idem_outbox_notify` leaves the
-- relays to their polling interval.
CREATE FUNCTION idem_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_outbox', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER idem_outbox_notify
    AFTER INSERT ON idem_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION idem_outbox_notify();
