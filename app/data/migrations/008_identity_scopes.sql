-- Identity scopes by kind (app/intake/identity.py): a user's idempotency scope is now
-- `u:<id>` and an anonymous caller's `a:<address>`, so that a user named `anon:<address>`
-- cannot replay an anonymous caller's scan. Rows written before keep answering their
-- retries: a user's old scope was the user id itself, an anonymous caller's
-- `anon:<address>`. Idempotent: a converted scope no longer equals its row's user id nor
-- starts with `anon:` on an anonymous row.
UPDATE scans SET idempotency_scope = 'u:' || idempotency_scope
    WHERE user_id IS NOT NULL AND idempotency_scope = user_id;
UPDATE scans SET idempotency_scope = 'a:' || substr(idempotency_scope, 6)
    WHERE user_id IS NULL AND idempotency_scope LIKE 'anon:%';
