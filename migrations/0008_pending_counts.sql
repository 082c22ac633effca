-- The pending counts the nodes of a group report (timeoutd_pending_rows), counted once
-- per group per http.pending_refresh instead of once per node: a node that finds the
-- kind's row older than its refresh counts the table (one node at a time: it holds the
-- row's lock meanwhile) and writes the result here; the others read it. A count walks
-- every pending row, which a hundred sidecars would otherwise each repeat.
CREATE TABLE IF NOT EXISTS pending_counts (
    kind text PRIMARY KEY,
    counted_at timestamptz NOT NULL,
    pending bigint NOT NULL,
    due bigint NOT NULL,
    overdue bigint NOT NULL,
    failing bigint NOT NULL
);

INSERT INTO pending_counts (kind, counted_at, pending, due, overdue, failing)
VALUES ('expectation', '-infinity', 0, 0, 0, 0), ('delayed', '-infinity', 0, 0, 0, 0)
ON CONFLICT (kind) DO NOTHING;
