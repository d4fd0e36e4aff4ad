-- Core schema. Every statement is idempotent: the migrator may apply a file again
-- (after its text changed, or from a second worker racing the first), so nothing
-- here may fail or duplicate data when run twice.

CREATE TABLE IF NOT EXISTS taxonomy_major (
    name         text PRIMARY KEY,
    description  text NOT NULL,
    recyclable   boolean NOT NULL DEFAULT false,
    sort_order   integer NOT NULL
);

CREATE TABLE IF NOT EXISTS taxonomy_middle (
    major        text NOT NULL REFERENCES taxonomy_major (name),
    name         text NOT NULL,
    description  text NOT NULL,
    sort_order   integer NOT NULL,
    PRIMARY KEY (major, name)
);

-- Minor items ("신문지", "우유팩"...). A minor belongs to a middle category when its
-- major has middles (the recyclables), and directly to the major otherwise.
-- Names are unique within a major, which is what the rule fallback relies on.
CREATE TABLE IF NOT EXISTS taxonomy_minor (
    major        text NOT NULL REFERENCES taxonomy_major (name),
    middle       text,
    name         text NOT NULL,
    sort_order   integer NOT NULL,
    PRIMARY KEY (major, name),
    FOREIGN KEY (major, middle) REFERENCES taxonomy_middle (major, name)
);

CREATE TABLE IF NOT EXISTS situation_tags (
    name         text PRIMARY KEY,          -- Korean label, also the value vision returns
    tag_group    text NOT NULL,             -- contamination | attachment | material | damage | hazard | size | state
    description  text NOT NULL,
    sort_order   integer NOT NULL
);

-- One rule document per recyclable middle category, and one per other major
-- (middle IS NULL). The document is JSON so its shape can grow without migrations:
-- {"title", "summary", "preparation": [..], "disposal": [..],
--  "not_accepted": [{"item", "instead"}], "tips": [..]}
CREATE TABLE IF NOT EXISTS disposal_rules (
    id           bigserial PRIMARY KEY,
    major        text NOT NULL REFERENCES taxonomy_major (name),
    middle       text,
    document     jsonb NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE NULLS NOT DISTINCT (major, middle)
);

-- Rules are cached in memory; any change notifies the caches so they drop stale entries.
CREATE OR REPLACE FUNCTION notify_disposal_rules_changed() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('disposal_rules_changed', '');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS disposal_rules_changed ON disposal_rules;
CREATE TRIGGER disposal_rules_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON disposal_rules
    FOR EACH STATEMENT EXECUTE FUNCTION notify_disposal_rules_changed();

-- Collectible characters: one per recyclable middle category, plus exactly one
-- default (middle IS NULL) for recyclables without a character of their own.
CREATE TABLE IF NOT EXISTS characters (
    code         text PRIMARY KEY,
    name         text NOT NULL,
    middle       text UNIQUE NULLS NOT DISTINCT,
    dialog       text NOT NULL,
    description  text NOT NULL
);

CREATE TABLE IF NOT EXISTS character_ownership (
    user_id         text NOT NULL,
    character_code  text NOT NULL REFERENCES characters (code),
    scan_id         uuid NOT NULL,
    acquired_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (user_id, character_code)
);

CREATE TABLE IF NOT EXISTS scans (
    id              uuid PRIMARY KEY,
    user_id         text,
    status          text NOT NULL CHECK (status IN ('running', 'completed', 'failed', 'cancelled')),
    image_source    text NOT NULL,              -- upload | data_url | url
    image_sha256    text,
    user_input      text,
    classification  jsonb,
    situation_tags  jsonb,
    disposal_rules  jsonb,
    answer          jsonb,
    reward          jsonb,
    timings         jsonb,
    error_step      text,
    error_code      text,
    error_message   text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);

CREATE INDEX IF NOT EXISTS scans_user_created ON scans (user_id, created_at DESC);
CREATE INDEX IF NOT EXISTS scans_status ON scans (status) WHERE status = 'running';
