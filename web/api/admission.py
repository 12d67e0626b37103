"""A completion's admission and enqueue in one round trip: the model's queue (a live worker, room in
it), the caller's `open` quota (a stream or a synchronous wait), its rate limits and blocklist
entries, and its `jobs` quota, in that order, then rq's enqueue of the job, in one Lua script made of
each concern's own script (web/api/queue.py `LOAD` and `RUN`, web/access/quotas.py `TAKE`,
web/access/ratelimit.py `RESERVE`).

The script stops at the first refusal, so a refused request takes nothing after it (a 503 for want
of a worker spends none of the caller's rate limit) and queues nothing; what the steps before it took
is given back here as the modules would give it back (the hold released, the reservation settled).
The enqueue is rq's own (`JobQueue.prepare`): its commands, queued by rq on a transaction that is
not run, run in the script once every check passed.
"""
from __future__ import annotations

import redis

from web import access
from web.access import quotas, ratelimit
from web.access.quotas import Hold
from web.api.queue import LOAD, RUN, JobQueue, commands


def _function(name: str, script: str) -> str:
    """A module's script as a Lua function of its own KEYS and ARGV."""
    return f"local function {name}(KEYS, ARGV)\n{script}\nend\n"


# KEYS: the queue's two (LOAD's), then those of the steps. ARGV[1]: the queue depth that is full;
# ARGV[2..7]: the number of keys and of arguments of each step (the open hold's take, the
# reservation, the jobs' take; 0 and 0: a step with nothing to take), then the steps' arguments,
# then the enqueue's commands (RUN's). Returns {0, load, replies of the steps}, the job queued, or,
# refused, {the refusing step (1: the queue), load, replies up to the refusing one's}.
_ADMIT = (_function("queue_load", LOAD) + _function("take", quotas.TAKE) + _function("reserve", ratelimit.RESERVE)
          + _function("run", RUN) + """
local function slice(t, from, n)
  local out = {}
  for i = 1, n do out[i] = t[from + i - 1] end
  return out
end
local queue = queue_load({KEYS[1], KEYS[2]}, {})
if tonumber(queue[1]) == 0 or tonumber(queue[2]) >= tonumber(ARGV[1]) then return {1, queue} end
local out, k, a = {0, queue}, 3, 8
for step = 1, 3 do
  local nk, na = tonumber(ARGV[2 * step]), tonumber(ARGV[2 * step + 1])
  local reply = {1, 0}
  if nk + na > 0 then
    local keys, args = slice(KEYS, k, nk), slice(ARGV, a, na)
    if step == 2 then reply = reserve(keys, args) else reply = take(keys, args) end
    k, a = k + nk, a + na
  end
  out[step + 2] = reply
  if tonumber(reply[1]) ~= 1 then
    out[1] = step + 1
    return out
  end
end
run({}, slice(ARGV, a, #ARGV - a + 1))
return out
""")


def admit(jq: JobQueue, caller: access.Caller, user: str | None, model_id: str, reserved_tokens: int,
          job_id: str, job_lapses_at: float, hold: Hold | None, enqueue: redis.client.Pipeline) -> access.Grant:
    """Admit a job of `model_id` for `caller` (and its end `user`), reserving `reserved_tokens`, its
    place in the `jobs` quota until `job_lapses_at`, and `hold`'s in `open` (made with `take=False`;
    None for a polled job), and run `enqueue`'s commands (`JobQueue.prepare`'s). Returns the grant,
    the job queued, or raises the first refusal's error with what was taken before it given back
    and nothing queued."""
    jobs, scope = access.quota("jobs"), access.quota_scope(caller)
    steps = [hold.take_call() if hold is not None else None, access.admission_call(caller, user, reserved_tokens),
             jobs.take_call(scope, job_id, job_lapses_at) if jobs.cap else None]
    keys, args = jq.load_keys(model_id), [jq.settings.max_queue_depth]
    for call in steps:
        args += [len(call[0]), len(call[1])] if call else [0, 0]
    for call in steps:
        if call:
            keys += call[0]
            args += call[1]
    args += commands(enqueue)
    r = access.redis_client()
    try:
        refused_at, load, *replies = r.register_script(_ADMIT)(keys=keys, args=args)
    except Exception:  # what it took, if it ran, lapses; the hold is given back now
        if hold is not None:
            hold.release()
        raise
    error = jq.capacity_error(model_id, int(load[0]), int(load[1]))
    if error is not None:
        raise error
    if refused_at == 2:
        raise hold.quota.exceeded(quotas.take_reply(replies[0])[1])
    try:
        reservation = ratelimit.reservation(replies[1], access.admission_buckets(caller, user))
        grant = access.granted(reservation, caller, user, reserved_tokens)
        if refused_at == 4:
            try:
                jobs.take_at_cap(r, scope, job_id, job_lapses_at, quotas.take_reply(replies[2])[1], ended=jq.ended)
                with enqueue:  # the script stopped before it
                    enqueue.execute()
            except Exception:
                access.settle(grant, 0)
                raise
    except Exception:
        if hold is not None:
            hold.release()
        raise
    return grant
