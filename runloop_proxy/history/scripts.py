"""The store's Lua scripts: each runs atomically inside the session's Redis Cluster slot.

SYNC makes a session's head branch hold the conversation a client sent — append what is new,
keep the branch when the client sent a prefix of it, or fork at the first difference (the old
branch stays). Messages are compared by their match hashes (chained), stored by their content
hashes. A client that restates the reply the proxy recorded in its own format (smolagents
turns tool calls into text) replaces that reply in place instead of forking on every request.
Past ``max_branches`` the least recently used branch is pruned, and a record says so. The client
side sends chain hashes and bodies from the length it last saw; when that hint is stale the
script answers "need" with the stored length. APPEND adds messages to the head whatever it holds
(server-history mode). LOAD reads what a replica needs of a session it has not seen.

Per message the client side sends a kind: ``c`` a client's message, ``a`` an assistant message
the client sent, ``r`` a reply the proxy recorded from the upstream.
"""

COMMON = r"""
local TOOLS = {}
local function flush_tools(p)
  for id, t in pairs(TOOLS) do
    if t.dirty then redis.call('HSET', p .. ':tool', id, table.concat(t.parts)) end
  end
  TOOLS = {}
end

local function store_message(p, h, body, tool_id, tokens, now)
  redis.call('HSETNX', p .. ':msg', h, body)
  redis.call('HSETNX', p .. ':ts', h, now)
  if tool_id ~= '' then
    -- every result of a call id, in order: ids repeat in real traces. Gathered per script
    -- run (a set and a list per id) and written once by flush_tools: linear in the results
    local t = TOOLS[tool_id]
    if not t then
      local cur = redis.call('HGET', p .. ':tool', tool_id) or ''
      t = {seen = {}, parts = {cur}, dirty = false}
      for i = 1, #cur, 32 do t.seen[string.sub(cur, i, i + 31)] = true end
      TOOLS[tool_id] = t
    end
    if not t.seen[h] then
      t.seen[h] = true; t.parts[#t.parts + 1] = h; t.dirty = true
    end
  end
  if tokens ~= '' then redis.call('HSETNX', p .. ':tok', h, tokens) end
end

local function record(p, rec)
  redis.call('RPUSH', p .. ':rec', cjson.encode(rec))
  redis.call('LTRIM', p .. ':rec', -1000, -1)
end

-- the least recently used branch but keep, gone (its messages stay content-addressed)
local function prune_lru(p, keep, now, reason)
  local oldest = redis.call('ZRANGE', p .. ':bused', 0, 1)
  local victim = oldest[1]
  if victim == keep then victim = oldest[2] end
  if not victim then return '', 0 end
  local info = redis.call('HGET', p .. ':branches', victim)
  local length = redis.call('LLEN', p .. ':b:' .. victim)
  local rec = {kind = 'branch_pruned', branch = tonumber(victim), ts = tonumber(now),
               length = length, reason = reason}
  if info then
    local b = cjson.decode(info)
    rec.parent = b.parent; rec.fork_at = b.fork_at
  end
  record(p, rec)
  redis.call('DEL', p .. ':b:' .. victim, p .. ':c:' .. victim)
  redis.call('ZREM', p .. ':bused', victim)
  redis.call('HDEL', p .. ':branches', victim)
  return victim, length
end

-- every key of the session expires ttl after its last write: the session's own keys and the
-- head branch (any of them may have been created just now) each time, the other branches'
-- lists at most every ttl/20 (there may be hundreds)
local function touch(p, head, now, ttl)
  redis.call('ZADD', p .. ':bused', now, head)
  local meta = p .. ':meta'
  for _, k in ipairs({'meta', 'msg', 'ts', 'tok', 'tool', 'branches', 'int', 'intk', 'rec',
                      'bused', 'sum', 'req', 'b:' .. head, 'c:' .. head}) do
    redis.call('PEXPIRE', p .. ':' .. k, ttl)
  end
  local xat = tonumber(redis.call('HGET', meta, 'xat') or '0')
  if tonumber(now) - xat > ttl / 20 then
    redis.call('HSET', meta, 'xat', now)
    for _, b in ipairs(redis.call('ZRANGE', p .. ':bused', 0, -1)) do
      redis.call('PEXPIRE', p .. ':b:' .. b, ttl)
      redis.call('PEXPIRE', p .. ':c:' .. b, ttl)
    end
  end
end
"""

# A session's stored tool exchanges, and the token counts of messages by their content hashes
# (joined, 32 characters each: one argument however many there are; redis-py packs each
# argument in Python on the event loop). KEYS: the session's :int and :tok hashes.
LOAD_LUA = r"""
local hs = ARGV[1]
local counts = {}
for i = 1, #hs, 32 do
  counts[#counts + 1] = redis.call('HGET', KEYS[2], string.sub(hs, i, i + 31)) or false
end
return {redis.call('HGETALL', KEYS[1]), counts, redis.call('HGETALL', KEYS[3])}
"""

# A key written outside SYNC/APPEND (records, the proxy's tool rounds, summaries) expires with
# its session: KEYS[1] is the session's meta, whose remaining time the others get. Before the
# session's first sync there is none (and a request refused or cut never syncs): then the
# session's retention, ARGV[1] ms; the first sync's touch sets every key's again.
# When a session's messages were first seen (``store.put_dates``): ARGV[1] packs the
# request's new ``name\tms`` pairs a line each (packed in one string off the event loop: a
# command per date cost the loop a hundred calls a message); the first date of a name wins.
PUT_DATES_LUA = r"""
for name, ms in string.gmatch(ARGV[1], "([^\t\n]+)\t([^\n]+)") do
  redis.call('HSETNX', KEYS[1], name, ms)
end
return 0
"""

# A summary's lock taken: KEYS[1] is the lock, ARGV[1] the new token, ARGV[2] its life in
# milliseconds, ARGV[3] a token this holder took it with before and could not release (Redis
# refused the release): free, or still that one, it is this holder's again; 1 when taken.
LOCK_LUA = r"""
local held = redis.call('GET', KEYS[1])
if held == false or (ARGV[3] ~= '' and held == ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# A summary's lock released by the holder that took it: KEYS[1] is the lock, ARGV[1] the
# token it was taken with. A holder whose lock expired (and was taken by another replica)
# deletes nothing: the other's summary stays the only one in flight.
UNLOCK_LUA = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

EXPIRE_WITH_SESSION_LUA = r"""
local t = redis.call('PTTL', KEYS[1])
if t <= 0 then t = tonumber(ARGV[1]) end
for i = 2, #KEYS do redis.call('PEXPIRE', KEYS[i], t) end
return t
"""

# The proxy's exchanges of a session: the :int hash (anchor -> exchange) and the :intk log, its
# anchors in the order written after a first entry "g:<generation>". A replica remembers how
# far it read which generation; a log that is missing, from before generations, or shorter
# than the hash (a key evicted, expired or deleted apart from the other) is made again under
# a new generation, so every replica reads it all again: none goes on with a stale or partial
# set it takes for the whole. A log whose hash is gone goes too.
INTK = r"""
local function intk_log(p, new_gen, ttl)
  local logk, intk = p .. ':intk', p .. ':int'
  local first = redis.call('LINDEX', logk, 0)
  local nk = redis.call('LLEN', logk) - 1
  local held = redis.call('HLEN', intk)
  if held == 0 then
    if first then redis.call('DEL', logk) end
    return 0, ''
  end
  if not first or string.sub(first, 1, 2) ~= 'g:' or nk < held then
    redis.call('DEL', logk)
    redis.call('RPUSH', logk, 'g:' .. new_gen)
    for _, a in ipairs(redis.call('HKEYS', intk)) do redis.call('RPUSH', logk, a) end
    if ttl and ttl > 0 then redis.call('PEXPIRE', logk, ttl) end
    return held, new_gen
  end
  return nk, string.sub(first, 3)
end
"""

SYNC_LUA = COMMON + INTK + r"""
local p = ARGV[1]
local hint = tonumber(ARGV[2]); local n = tonumber(ARGV[3])
local chains = ARGV[4]; local hashes = ARGV[5]
local now = ARGV[6]; local ttl = tonumber(ARGV[7])
local maxm = tonumber(ARGV[8]); local maxb = tonumber(ARGV[9]); local sid = ARGV[10]
local basechain = ARGV[11]; local kinds = ARGV[12]
local meta = p .. ':meta'
if n > maxm then return {'limit', 'messages'} end
-- the bodies a session keeps, every branch's and pruned ones' together (content-addressed,
-- they stay until the session expires): at most ARGV[20] (a client forking new messages on
-- every request would otherwise grow them for good)
local maxs = tonumber(ARGV[20] or '0')
if maxs > 0 and redis.call('HLEN', p .. ':msg') + n - hint > maxs then
  return {'limit', 'stored messages'}
end
local head = redis.call('HGET', meta, 'head') or '0'
local L = tonumber(redis.call('HGET', meta, 'len') or '0')
local tip = redis.call('HGET', meta, 'tip') or ''
local function chain_at(i)
  if i == 0 then return '' end
  local off = (i - hint - 1) * 40
  return string.sub(chains, off + 1, off + 40)
end
local function hash_at(i)
  local off = (i - hint - 1) * 32
  return string.sub(hashes, off + 1, off + 32)
end
local function kind_at(i) return string.sub(kinds, i - hint, i - hint) end
local bl = p .. ':b:' .. head
local cl = p .. ':c:' .. head
local common = -1
if L == hint then
  if hint == 0 or basechain == tip then common = L end
elseif L > hint and L <= n and chain_at(L) == tip then
  common = L
elseif L >= n and n > hint and redis.call('LINDEX', cl, n - 1) == chain_at(n) then
  common = n
elseif L >= n and n == hint and redis.call('LINDEX', cl, n - 1) == basechain then
  common = n
end
local forked = 0
local pruned = ''
if common < 0 then
  if hint ~= 0 then return {'need', tostring(L)} end
  -- diverged: the longest stored prefix that matches (chains match on a prefix only)
  local lo, hi = 0, math.min(L, n)
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if redis.call('LINDEX', cl, mid - 1) == chain_at(mid) then lo = mid else hi = mid - 1 end
  end
  local tipk = redis.call('HGET', meta, 'tipk') or ''
  if lo == L - 1 and n >= L and tipk == 'r' and kind_at(L) == 'a' then
    -- the client restated the reply the proxy recorded, in its own format: it replaces it
    redis.call('RPOP', bl); redis.call('RPOP', cl)
    L = lo; common = lo
    record(p, {kind = 'reply_restated', branch = tonumber(head), at = lo, ts = tonumber(now)})
  else
    if redis.call('ZCARD', p .. ':bused') == 0 then redis.call('ZADD', p .. ':bused', now, head) end
    local nb = redis.call('HINCRBY', meta, 'nbranches', 1)
    local nbl = p .. ':b:' .. nb
    local ncl = p .. ':c:' .. nb
    local step = 1000
    for s = 0, lo - 1, step do
      local e = math.min(s + step, lo) - 1
      redis.call('RPUSH', nbl, unpack(redis.call('LRANGE', bl, s, e)))
      redis.call('RPUSH', ncl, unpack(redis.call('LRANGE', cl, s, e)))
    end
    redis.call('HSET', p .. ':branches', tostring(nb),
      cjson.encode({parent = tonumber(head), fork_at = lo, created = tonumber(now)}))
    head = tostring(nb); bl = nbl; cl = ncl; L = lo; common = lo; forked = 1
    redis.call('ZADD', p .. ':bused', now, head)
    if redis.call('ZCARD', p .. ':bused') > maxb then
      pruned = prune_lru(p, head, now, 'max_branches')
    end
    -- every fork copies its prefix: the session's branches together hold at most ARGV[16]
    -- entries, max_branch_messages (a client forking every turn would otherwise keep
    -- max_branches copies of its whole conversation); the least recently used go first
    local held = 0
    for _, b in ipairs(redis.call('ZRANGE', p .. ':bused', 0, -1)) do
      held = held + redis.call('LLEN', p .. ':b:' .. b)
    end
    local cap = tonumber(ARGV[16] or '0')
    while cap > 0 and held > cap and redis.call('ZCARD', p .. ':bused') > 1 do
      local victim, length = prune_lru(p, head, now, 'max_branch_messages')
      if victim == '' then break end
      held = held - length
      pruned = pruned == '' and victim or (pruned .. ',' .. victim)
    end
  end
end
local tipk = nil
-- the new messages' bodies arrive joined in one argument, with a JSON array of
-- [length, tool call id, tokens] per message (a few arguments, whatever their number)
local blob = ARGV[13]
local items = cjson.decode(ARGV[14])
local starts = {}
local off = 0
for k = 1, #items do starts[k] = off; off = off + items[k][1] end
for i = common + 1, n do
  local h = hash_at(i)
  local it = items[i - hint]
  local at = starts[i - hint]
  store_message(p, h, string.sub(blob, at + 1, at + it[1]), it[2], it[3], now)
  redis.call('RPUSH', bl, h)
  redis.call('RPUSH', cl, chain_at(i))
  L = i; tip = chain_at(i); tipk = kind_at(i)
end
redis.call('HSET', meta, 'head', head, 'len', L, 'tip', tip, 'updated', now, 'sid', sid)
if tipk then redis.call('HSET', meta, 'tipk', tipk) end
flush_tools(p)
redis.call('HSETNX', meta, 'created', now)
touch(p, head, now, ttl)
-- the proxy's tool exchanges written since the caller last read them: ARGV[15] entries of
-- the :intk log of generation ARGV[17] (a sync reads what is new, not the session's past)
local internal = {}
local nk, gen = intk_log(p, ARGV[18], ttl)
local seen = tonumber(ARGV[15] or '0')
if gen ~= ARGV[17] or seen > nk then seen = 0 end  -- another log than the caller's: all of it
-- the same log, rolled back (a failover that lost writes) and grown again: the entry the
-- caller read last (ARGV[19]) is not where it read it
if seen > 0 and redis.call('LINDEX', p .. ':intk', seen) ~= ARGV[19] then seen = 0 end
if seen < nk then
  local got = {}
  for _, a in ipairs(redis.call('LRANGE', p .. ':intk', seen + 1, -1)) do
    if not got[a] then
      got[a] = true
      local v = redis.call('HGET', p .. ':int', a)
      if v then internal[#internal + 1] = a; internal[#internal + 1] = v end
    end
  end
end
local last = ''
if nk > 0 then last = redis.call('LINDEX', p .. ':intk', nk) end
return {'ok', tostring(L), head, tostring(forked), tostring(common), internal, pruned,
        tostring(nk), tostring(seen), gen, last}
"""

# A proxy tool exchange kept (``RedisStore.add_internal``): the :int hash and its :intk log
# written together. KEYS[1]: the session's meta; ARGV: prefix, anchor, exchange, a new
# generation, used if the log is made anew (then every replica reads it all again), and the
# session's retention in ms (its keys' time while it has no meta yet).
ADD_INTERNAL_LUA = INTK + r"""
local p = ARGV[1]
local nk, gen = intk_log(p, ARGV[4], 0)  -- the log as it stands, made right
redis.call('HSET', p .. ':int', ARGV[2], ARGV[3])
if gen == '' then  -- the session held none: its log starts now
  nk, gen = intk_log(p, ARGV[4], 0)
else
  redis.call('RPUSH', p .. ':intk', ARGV[2])
end
local t = redis.call('PTTL', KEYS[1])
if t <= 0 then t = tonumber(ARGV[5]) end  -- no sync yet: the session's retention
redis.call('PEXPIRE', p .. ':int', t); redis.call('PEXPIRE', p .. ':intk', t)
return {redis.call('LLEN', p .. ':intk') - 1, gen, gen == ARGV[4] and 1 or 0}
"""

APPEND_LUA = COMMON + r"""
local p = ARGV[1]; local now = ARGV[2]
local ttl = tonumber(ARGV[3]); local maxm = tonumber(ARGV[4])
local sid = ARGV[5]; local nsys = tonumber(ARGV[6]); local maxs = tonumber(ARGV[7])
local token = ARGV[8]
local meta = p .. ':meta'
local head = redis.call('HGET', meta, 'head') or '0'
local L = tonumber(redis.call('HGET', meta, 'len') or '0')
local tip = redis.call('HGET', meta, 'tip') or ''
-- a job sent again after Redis applied it (its reply lost with the connection, a master
-- that died after the write): applied once, whatever the tries
local done = redis.call('HGET', meta, 'wtok') or ''
if token ~= '' and string.find(done, token, 1, true) then return {'ok', tostring(L)} end
local k = (#ARGV - 8) / 6
local first = 0
if L > 0 then first = nsys end  -- a system prompt is history only when it opens the session
if L + k - first > maxm then return {'limit'} end
if maxs > 0 and redis.call('HLEN', p .. ':msg') + k > maxs then return {'limit'} end
local bl = p .. ':b:' .. head
local cl = p .. ':c:' .. head
local tipk = nil
for i = first, k - 1 do
  local j = 9 + i * 6
  local h = ARGV[j]
  store_message(p, h, ARGV[j + 2], ARGV[j + 3], ARGV[j + 4], now)
  tip = redis.sha1hex(tip .. ARGV[j + 1])
  redis.call('RPUSH', bl, h)
  redis.call('RPUSH', cl, tip)
  L = L + 1; tipk = ARGV[j + 5]
end
-- the newest appends' tokens (a batch sent again holds several of one session)
done = string.sub(token .. ',' .. done, 1, 16 * (#token + 1))
redis.call('HSET', meta, 'head', head, 'len', L, 'tip', tip, 'updated', now, 'sid', sid,
           'wtok', done)
if tipk then redis.call('HSET', meta, 'tipk', tipk) end
redis.call('HSETNX', meta, 'created', now)
redis.call('HSET', meta, 'xat', 0)  -- appends are rare: refresh every branch's expiry now
flush_tools(p)
touch(p, head, now, ttl)
return {'ok', tostring(L)}
"""

# Long-term memory: which of a session's segments (fields of its :mem hash, ARGV) have no
# vector yet, as their 1-based places; one round trip whatever the count.
MISSING_LUA = r"""
local out = {}
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then out[#out + 1] = i end
end
return out
"""
