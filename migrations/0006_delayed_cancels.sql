-- Cancel messages remembered (README, "Cancel"): with several nodes consuming the ingress
-- queue, a cancel can be stored by one node while another is still storing the message it
-- cancels. The cancel leaves its message_id here until expires_at (delay.cancel_ttl); a
-- message arriving with a remembered id is dropped as cancelled, and so is a redelivery of
-- one the cancel deleted. The ingest transactions order themselves by advisory locks on
-- hash buckets of the message_id (shared to store, exclusive to cancel), so whichever of
-- the two commits second sees the other. Nodes of the previous version neither write nor
-- read this table: a mixed group cancels as before, exactly once all nodes are upgraded.

CREATE TABLE IF NOT EXISTS delayed_cancels (
    message_id  text        PRIMARY KEY,
    expires_at  timestamptz NOT NULL
);

CREATE INDEX IF NOT EXISTS delayed_cancels_expires_at_idx
    ON delayed_cancels (expires_at);
