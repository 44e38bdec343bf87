-- One row per (handler, message) that has been processed and committed.
-- The primary key is the claim: a second transaction inserting the same key
-- waits for the first, then conflicts if it committed.
CREATE TABLE idem_processed_messages (
    handler      text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (handler, message_id)
);

-- Retention deletes by age; this keeps that delete from scanning the table.
CREATE INDEX idem_processed_messages_processed_at
    ON idem_processed_messages (processed_at);
