-- What each scan's upstream calls cost, USD, priced from the usage they reported
-- (app/upstream/prices.py); NULL while running, for a scan with an unpriced call, and for
-- rows older than this column. Spend per user and day: docs/deploy.md.
ALTER TABLE scans ADD COLUMN IF NOT EXISTS cost_usd numeric;
