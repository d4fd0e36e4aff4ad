-- Identity scopes by kind (app/intake/identity.py): a user's idempotency scope is now
-- `u:<id>` and an anonymous caller's `a:<address>`, so that a user named `anon:<address>`
-- cannot replay an anonymous caller's scan. Rows written before keep answering their
-- retries: a user's old scope was the user id itself, an anonymous caller's
-- `anon:<address>`.
-- The unique index on (scope, key) is checked row by row during an UPDATE, so users `bob`
-- and `u:bob` who used the same key would collide half-way (`bob` -> `u:bob` while the
-- other row still holds it): users' scopes go through a prefix no scope can hold (\x01)
-- first, and lose it once every row has moved. Idempotent: a converted scope no longer
-- equals its row's user id nor starts with `anon:` on an anonymous row.
UPDATE scans SET idempotency_scope = E'\x01u:' || idempotency_scope
    WHERE user_id IS NOT NULL AND idempotency_scope = user_id;
UPDATE scans SET idempotency_scope = substr(idempotency_scope, 2)
    WHERE idempotency_scope LIKE E'\x01%';
UPDATE scans SET idempotency_scope = 'a:' || substr(idempotency_scope, 6)
    WHERE user_id IS NULL AND idempotency_scope LIKE 'anon:%';
