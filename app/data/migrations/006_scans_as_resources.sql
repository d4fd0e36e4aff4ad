-- Scans as resources: the event log as sent (json, not jsonb: key order and number
-- text are kept, so a replay is byte-identical), idempotency keys (unique per caller:
-- concurrent duplicates race on this index, not on a check-then-insert), and the hash
-- of an anonymous scan's capability token.
ALTER TABLE scans ADD COLUMN IF NOT EXISTS event_log json;
ALTER TABLE scans ADD COLUMN IF NOT EXISTS idempotency_scope text;
ALTER TABLE scans ADD COLUMN IF NOT EXISTS idempotency_key text;
ALTER TABLE scans ADD COLUMN IF NOT EXISTS request_sha256 text;
ALTER TABLE scans ADD COLUMN IF NOT EXISTS token_sha256 text;
CREATE UNIQUE INDEX IF NOT EXISTS scans_idempotency
    ON scans (idempotency_scope, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS scans_created ON scans (created_at);
CREATE INDEX IF NOT EXISTS character_ownership_user ON character_ownership (user_id, acquired_at DESC);
