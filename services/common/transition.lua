-- Compare-and-set a session's state: the ONLY way a session changes state.
-- KEYS[1] session hash, KEYS[2] global state counts, KEYS[3] the leases sorted set
-- ARGV[1] to-state, ARGV[2] allowed from-states as ",A,B,", ARGV[3] expected version or "",
-- ARGV[4] now, ARGV[5] lease expiry or "" (taken with the change, in the same step, so
-- a holder that dies right after it still leaves a lease to expire),
-- ARGV[6] expected attempt or "" (a holder of an earlier attempt, back after its lease
-- was lost and the session retried elsewhere, changes nothing),
-- ARGV[7] a lease owner or "": drop the session's lease in the same step while that owner
-- still holds it (a finishing holder lets go with its last change: no release after it),
-- ARGV[8] an outbox message id or "", ARGV[9] its subject, ARGV[10] its payload: the
-- message that must follow this change (a retry's INIT work, a finish event) is kept in
-- the outbox in the same step, so neither a bus outage nor this process dying between
-- the change and the publish loses it (services/common/outbox.py relays it),
-- ARGV[11..] field/value pairs to set ("" deletes the field; a new `token` replaces the
-- old one's key; a new `attempt` sets `seq_floor`)
-- Returns {1, from, version, seq, node} on success (node: where the session is placed,
-- "" when nowhere, so every state-change event names it), {0, current, version, 0} when the CAS
-- fails, {-1, "", 0, 0} when the session does not exist. `seq` is a global order of all
-- transitions, so an event log can be replayed in exactly the order Redis applied it.
-- Sessions placed on a node are also kept in per-node sets (subjects.key_node_state).
-- Keys between at-signs are schemas/subjects.py's names (registry.expand_keys).
local cur = redis.call('HMGET', KEYS[1], 'state', 'version', 'task_id', 'node', 'attempt')
if not cur[1] then return {-1, '', 0, 0} end
if ARGV[3] ~= '' and cur[2] ~= ARGV[3] then return {0, cur[1], tonumber(cur[2]), 0} end
if ARGV[6] ~= '' and (cur[5] or '0') ~= ARGV[6] then return {0, cur[1], tonumber(cur[2]), 0} end
if not string.find(ARGV[2], ',' .. cur[1] .. ',', 1, true) then
  return {0, cur[1], tonumber(cur[2]), 0}
end
local sid = string.sub(KEYS[1], string.len(@key_session('')@) + 1)
if cur[4] then redis.call('SREM', @key_node_state(cur[4], cur[1])@, sid) end
local v = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'updated_at', ARGV[4])
if ARGV[5] ~= '' then redis.call('ZADD', KEYS[3], ARGV[5], sid) end
if ARGV[7] ~= '' and redis.call('HGET', KEYS[1], 'lease_owner') == ARGV[7] then
  redis.call('ZREM', KEYS[3], sid)
end
local old_token = redis.call('HGET', KEYS[1], 'token')
local new_attempt = false
for i = 11, #ARGV, 2 do
  if ARGV[i] == 'attempt' and ARGV[i + 1] ~= (cur[5] or '0') then new_attempt = true end
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[1], ARGV[i])
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
-- A new token (a retry gives the next attempt one): the old one dies in the same step,
-- so an earlier attempt's harness, still running on a host cut off past its lease, can
-- no longer call (and be captured) as the session. The new one expires as the first.
local token = redis.call('HGET', KEYS[1], 'token')
if token ~= old_token then
  if old_token then redis.call('DEL', @key_token(old_token)@) end
  if token then
    local deadline = tonumber(redis.call('HGET', KEYS[1], 'deadline') or ARGV[4])
    redis.call('SET', @key_token(token)@, sid, 'EXAT', math.ceil(deadline) + 3600)
  end
end
-- A new attempt (a retry) numbers its calls from the call counter as it is now, read in
-- the step that kills the old token: a lower number is an earlier attempt's, recorded or
-- not (one cut off mid-call never records its number; that is no loss of this attempt).
if new_attempt then
  redis.call('HSET', KEYS[1], 'seq_floor', redis.call('GET', @key_call_seq(sid)@) or '0')
end
-- per-task counts live beside the task (derived key: single-node Redis only)
local tc = @key_task_counts(cur[3])@
redis.call('HINCRBY', tc, cur[1], -1)
redis.call('HINCRBY', tc, ARGV[1], 1)
redis.call('HINCRBY', KEYS[2], cur[1], -1)
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
-- per-node sets hold live sessions only (final states would grow without bound)
local node = redis.call('HGET', KEYS[1], 'node')
local final = {COMPLETED = true, TIMEOUT = true, ERROR = true, CANCELLED = true}
if node and not final[ARGV[1]] then
  redis.call('SADD', @key_node_state(node, ARGV[1])@, sid)
end
-- The session's capture closes when it leaves RUNNING for good (POSTRUN, or ended): its
-- token dies with the change, so no later call is served (or captured after the read).
if ARGV[1] ~= 'REGISTERED' and ARGV[1] ~= 'INITIALIZING' and ARGV[1] ~= 'READY'
    and ARGV[1] ~= 'RUNNING' then
  local token = redis.call('HGET', KEYS[1], 'token')
  if token then redis.call('DEL', @key_token(token)@) end
end
if ARGV[8] ~= '' then
  redis.call('HSET', @KEY_OUTBOX@, ARGV[8], ARGV[9] .. '\n' .. ARGV[10])
  redis.call('ZADD', @KEY_OUTBOX_DUE@, ARGV[4], ARGV[8])
end
local seq = redis.call('INCR', @KEY_TRANSITION_SEQ@)
return {1, cur[1], v, seq, node or ''}
