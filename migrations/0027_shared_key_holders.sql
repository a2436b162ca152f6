-- Types that share a concurrency key (an explicit key several types name) are each admitted
-- under the strictest limit among the key's holders, not only their own (docs/design.md §109).
-- Each lease records its job's type; each key's row records the one type all its holders are
-- of (sole_type; NULL when they are of several, or unknown), so an admission of that type needs
-- no look at the leases, as before. Nullable columns without a default: adding them rewrites
-- nothing, and code of before this migration, which never reads them, keeps working. Leases
-- taken before it have no type, and a key held before it no sole type: such a key is looked at
-- lease by lease, each untyped lease counting under the key's recorded limit, until it is empty.
ALTER TABLE lockgate.leases ADD COLUMN IF NOT EXISTS job_type text;
ALTER TABLE lockgate.semaphores ADD COLUMN IF NOT EXISTS sole_type text;
