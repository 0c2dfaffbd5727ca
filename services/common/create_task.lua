-- Register a task and its sessions atomically, once.
-- Keys between at-signs are schemas/subjects.py's names (registry.expand_keys).
-- KEYS[1] task hash, KEYS[2] task's session list, KEYS[3] task counts,
-- KEYS[4] global counts, KEYS[5] active task set
-- ARGV[1] task id, ARGV[2] task spec json, ARGV[3] spec digest, ARGV[4] now,
-- ARGV[5] num sessions, then 5 values per session:
--   session id, token, index, priority, deadline
-- and last the task's replay spec json ('' when it replays nothing): each session keeps
-- it, so the proxy's call lookup reads it with the session (registry.SESSION_FOR_CALL)
-- Returns 1 when created, 0 when the same task exists, -1 when the id is taken by a
-- different spec.
local existing = redis.call('HGET', KEYS[1], 'digest')
if existing then
  if existing == ARGV[3] then return 0 end
  return -1
end
local n = tonumber(ARGV[5])
local replay = ARGV[6 + n * 5] or ''
redis.call('HSET', KEYS[1], 'task_id', ARGV[1], 'spec', ARGV[2], 'digest', ARGV[3],
  'submitted_at', ARGV[4], 'status', 'active', 'num_samples', n)
redis.call('SADD', KEYS[5], ARGV[1])
for i = 0, n - 1 do
  local b = 6 + i * 5
  local sid = ARGV[b]
  redis.call('HSET', @key_session(sid)@, 'session_id', sid, 'task_id', ARGV[1],
    'token', ARGV[b + 1], 'index', ARGV[b + 2], 'priority', ARGV[b + 3],
    'deadline', ARGV[b + 4], 'state', 'REGISTERED', 'version', 0, 'attempt', 0,
    'created_at', ARGV[4], 'updated_at', ARGV[4])
  if replay ~= '' then redis.call('HSET', @key_session(sid)@, 'replay', replay) end
  -- the token dies when the session leaves RUNNING (transition.lua), at the latest an
  -- hour past its deadline: no token key outlives its use
  redis.call('SET', @key_token(ARGV[b + 1])@, sid, 'EXAT',
    math.ceil(tonumber(ARGV[b + 4])) + 3600)
  redis.call('RPUSH', KEYS[2], sid)
end
redis.call('HINCRBY', KEYS[3], 'REGISTERED', n)
redis.call('HINCRBY', KEYS[4], 'REGISTERED', n)
return 1
