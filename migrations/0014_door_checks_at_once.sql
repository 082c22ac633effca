-- expect() checks its five short strings in one expression: a call of api_short() per
-- string cost about as much as the rest of the door's checks together. The refusals
-- are the same (54000, naming the first string over the bound); only a refused call
-- looks at the strings one by one. Replaces 0013's body; privileges stay.

CREATE OR REPLACE FUNCTION api_admit_expectation(exchange text, routing_key text,
    process_id text, message_type text, idempotency_key text, payload jsonb) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    r api_rules := api_rules_written();
BEGIN
    PERFORM api_destination(r, 'expectation', exchange);
    IF greatest(octet_length(exchange), octet_length(routing_key), octet_length(process_id),
            octet_length(message_type), octet_length(idempotency_key)) > r.max_short THEN
        PERFORM api_short('exchange', exchange, r.max_short);
        PERFORM api_short('routing_key', routing_key, r.max_short);
        PERFORM api_short('process_id', process_id, r.max_short);
        PERFORM api_short('message_type', message_type, r.max_short);
        PERFORM api_short('idempotency_key', idempotency_key, r.max_short);
    END IF;
    IF octet_length(payload::text) > r.max_payload THEN
        RAISE EXCEPTION 'payload of % bytes is larger than timeouts.max_payload (% bytes)',
            octet_length(payload::text), r.max_payload USING ERRCODE = 'program_limit_exceeded';
    END IF;
END
$$;
