-- Which process runs a scan. Each process tags its database connections with
-- application_name 'ecoscan <instance_id>'; a `running` row whose instance has no
-- connection left is a scan whose process died, and the start-up / periodic sweep
-- (app/scan_store.py) marks it failed / PROCESS_LOST. Rows from before this column
-- have no instance and are swept as lost.
ALTER TABLE scans ADD COLUMN IF NOT EXISTS instance_id uuid;
