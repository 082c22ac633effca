-- Runs with search_path set to the configured schema (postgres.schema), so every name
-- here lands in that schema.

CREATE TABLE IF NOT EXISTS expected_messages (
    id            uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    process_id    text        NOT NULL,
    message_type  text        NOT NULL,
    timeout_at    timestamptz NOT NULL,
    exchange      text        NOT NULL,
    routing_key   text        NOT NULL,
    payload       jsonb       NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text        NULL,
    -- Set only after a failed publish: the earliest time of the next attempt (backoff).
    -- Always later than timeout_at, so it can only delay a TimeOut, never advance it.
    retry_at      timestamptz NULL
);

-- The scan asks for rows with coalesce(retry_at, timeout_at) <= now(), ordered by the
-- same expression: an index range scan that stops at the first row not yet due.
CREATE INDEX IF NOT EXISTS expected_messages_due_idx
    ON expected_messages ((coalesce(retry_at, timeout_at)));
