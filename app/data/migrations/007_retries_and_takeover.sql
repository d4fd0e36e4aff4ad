-- A retry of a scan that ended with a retryable error (PROCESS_LOST, SERVER_SHUTDOWN, an
-- exhausted upstream...) under the same Idempotency-Key: the new attempt names the one it
-- retries, which let go of the key.
ALTER TABLE scans ADD COLUMN IF NOT EXISTS retry_of uuid;
-- Takeover (app/scans/liveness.py): the running scans of one instance, found when its
-- liveness lease lapses.
CREATE INDEX IF NOT EXISTS scans_running_instance ON scans (instance_id) WHERE status = 'running';
