-- The per-owner ledger credits what it charged, and the SQL door bounds every AMQP
-- short string (docs/integrating/sql-api.md).
--
-- * A message's bytes are its body and its properties as JSON text. The ledger charged
--   pg_column_size(properties) since 0007: uncompressed on insert, compressed on
--   delete, so an owner with large compressible headers kept usage it no longer had.
--   The ledger is counted again from the table once.
-- * The door refused over-long routing keys and ids; it now refuses an exchange name,
--   a string property or a header name over 255 bytes too, which firing would hold.
-- * delayed_usage_admit() refuses arrays of different lengths and NULLs, and compares
--   without overflow (the daemon passes the largest bigint for no bound).
--
-- Rolling upgrade: safe. Holds the table in SHARE mode while it counts (writers wait;
-- about a second per million pending messages).

CREATE OR REPLACE FUNCTION delayed_usage_size(body bytea, properties jsonb) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(octet_length(body), 0) + coalesce(octet_length(properties::text), 0)
$$;

CREATE OR REPLACE FUNCTION delayed_usage_count() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO delayed_usage (owner, messages, bytes)
        SELECT owner, count(*), sum(delayed_usage_size(body, properties))
        FROM new_rows GROUP BY owner;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO delayed_usage (owner, messages, bytes)
        SELECT owner, -count(*), -sum(delayed_usage_size(body, properties))
        FROM old_rows GROUP BY owner;
    ELSE
        -- Most updates (a failed delivery charged) change neither: nothing written.
        INSERT INTO delayed_usage (owner, messages, bytes)
        SELECT owner, sum(n), sum(b) FROM (
            SELECT owner, 1 AS n, delayed_usage_size(body, properties) AS b FROM new_rows
            UNION ALL
            SELECT owner, -1, -delayed_usage_size(body, properties) FROM old_rows) AS d
        GROUP BY owner HAVING sum(n) <> 0 OR sum(b) <> 0;
    END IF;
    RETURN NULL;
END
$$;

LOCK TABLE delayed_messages IN SHARE MODE;
DELETE FROM delayed_usage;
INSERT INTO delayed_usage (owner, messages, bytes)
SELECT owner, count(*), sum(delayed_usage_size(body, properties))
FROM delayed_messages GROUP BY owner;

CREATE OR REPLACE FUNCTION delayed_usage_admit(owners text[], sizes bigint[],
    max_messages bigint, max_bytes bigint) RETURNS boolean[]
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    u_owner text[] := '{}';
    u_messages bigint[] := '{}';
    u_bytes bigint[] := '{}';
    m bigint;
    b bigint;
    ledger_rows bigint;
    admitted boolean[] := '{}';
    j int;
BEGIN
    IF max_messages IS NULL OR max_bytes IS NULL
       OR coalesce(array_length(owners, 1), 0) <> coalesce(array_length(sizes, 1), 0)
       OR array_position(owners, NULL) IS NOT NULL OR array_position(sizes, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'delayed_usage_admit takes one size per owner and no NULL'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT (owners <@ ARRAY[api_owner()]) AND NOT api_acts_for_others('delayed_messages') THEN
        RAISE EXCEPTION 'role % may ask only about its own delayed messages', session_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    FOR i IN 1 .. coalesce(array_length(owners, 1), 0) LOOP
        j := array_position(u_owner, owners[i]);
        IF j IS NULL THEN
            SELECT greatest(coalesce(sum(u.messages), 0), 0), greatest(coalesce(sum(u.bytes), 0), 0),
                   count(*)
                INTO m, b, ledger_rows
                FROM delayed_usage AS u WHERE u.owner = owners[i];
            IF ledger_rows > 32 THEN
                PERFORM delayed_usage_fold(ARRAY[owners[i]]);
            END IF;
            u_owner := u_owner || owners[i];
            u_messages := u_messages || m;
            u_bytes := u_bytes || b;
            j := array_length(u_owner, 1);
        END IF;
        -- Differences, not sums: the largest bigint stands for no bound.
        IF u_messages[j] >= max_messages OR greatest(sizes[i], 0) > max_bytes - u_bytes[j] THEN
            admitted := admitted || false;
        ELSE
            u_messages[j] := u_messages[j] + 1;
            u_bytes[j] := u_bytes[j] + greatest(sizes[i], 0);
            admitted := admitted || true;
        END IF;
    END LOOP;
    RETURN admitted;
END
$$;
ALTER FUNCTION delayed_usage_admit(text[], bigint[], bigint, bigint) SET enable_bitmapscan = off;

CREATE OR REPLACE FUNCTION api_admit_expectation(exchange text, routing_key text,
    process_id text, message_type text, idempotency_key text, payload jsonb) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    r api_rules := api_rules_written();
BEGIN
    PERFORM api_destination(r, 'expectation', exchange);
    PERFORM api_short('exchange', exchange, r.max_short);
    PERFORM api_short('routing_key', routing_key, r.max_short);
    PERFORM api_short('process_id', process_id, r.max_short);
    PERFORM api_short('message_type', message_type, r.max_short);
    PERFORM api_short('idempotency_key', idempotency_key, r.max_short);
    IF octet_length(payload::text) > r.max_payload THEN
        RAISE EXCEPTION 'payload of % bytes is larger than timeouts.max_payload (% bytes)',
            octet_length(payload::text), r.max_payload USING ERRCODE = 'program_limit_exceeded';
    END IF;
END
$$;

-- Every string property and every header name of stored properties within a short
-- string (header values are long strings).
CREATE OR REPLACE FUNCTION api_short_properties(stored jsonb, max_short integer) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    p record;
BEGIN
    FOR p IN SELECT key, value #>> '{}' AS v FROM jsonb_each(stored)
            WHERE key <> 'headers' AND jsonb_typeof(value) = 'string' LOOP
        PERFORM api_short(p.key, p.v, max_short);
    END LOOP;
    FOR p IN SELECT h ->> 0 AS name FROM jsonb_array_elements(coalesce(stored -> 'headers', '[]')) AS h LOOP
        PERFORM api_short('header name', p.name, max_short);
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION api_admit_delayed(exchange text, routing_key text, body bytea,
    deliver_at timestamptz, properties jsonb, message_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    r api_rules := api_rules_written();
    stored jsonb;
    size bigint;
BEGIN
    PERFORM api_destination(r, 'delayed', exchange);
    PERFORM api_short('exchange', exchange, r.max_short);
    PERFORM api_short('routing_key', routing_key, r.max_short);
    PERFORM api_short('message_id', message_id, r.max_short);
    IF octet_length(body) > r.max_body THEN
        RAISE EXCEPTION 'body of % bytes is larger than delay.max_body (% bytes)',
            octet_length(body), r.max_body USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF deliver_at > now() + r.max_delay THEN
        RAISE EXCEPTION 'deliver_at % is later than delay.max_delay (%) allows', deliver_at, r.max_delay
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    -- Before anything is built from them: a bound on what the caller handed over.
    IF octet_length(properties::text) > r.max_properties THEN
        RAISE EXCEPTION 'properties of % bytes are larger than % bytes',
            octet_length(properties::text), r.max_properties USING ERRCODE = 'program_limit_exceeded';
    END IF;
    stored := api_properties(properties, message_id);
    IF jsonb_array_length(coalesce(stored->'headers', '[]')) > r.max_headers THEN
        RAISE EXCEPTION '% headers are more than %', jsonb_array_length(stored->'headers'), r.max_headers
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF octet_length(stored::text) > r.max_properties THEN
        RAISE EXCEPTION 'properties of % bytes as stored are larger than % bytes',
            octet_length(stored::text), r.max_properties USING ERRCODE = 'program_limit_exceeded';
    END IF;
    PERFORM api_short_properties(stored, r.max_short);
    size := delayed_usage_size(body, stored);
    IF NOT (delayed_usage_admit(ARRAY[api_owner()], ARRAY[size], r.max_pending_per_owner,
            r.max_bytes_per_owner))[1] THEN
        RAISE EXCEPTION 'owner % has no room for one more message of % bytes under delay.max_pending_per_owner (%) and delay.max_bytes_per_owner (% bytes)',
            api_owner(), size, r.max_pending_per_owner, r.max_bytes_per_owner
            USING ERRCODE = 'configuration_limit_exceeded';
    END IF;
    RETURN stored;
END
$$;

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
            'delayed_usage_size(bytea, jsonb)'::regprocedure,
            'api_short_properties(jsonb, integer)'::regprocedure] LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    EXECUTE format('ALTER FUNCTION delayed_usage_admit(text[], bigint[], bigint, bigint) '
        'SET search_path = %I, pg_temp', current_schema());
END
$$;
