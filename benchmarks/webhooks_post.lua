-- wrk script of benchmarks/webhooks.py: POST one new Telegram update per request.
--
-- Every request carries a unique update_id (so the gateway stores every one of them as a new
-- message): thread k of a run sends WEBHOOKS_ID_BASE + k * 10^7 + 1, + 2, ... in order. Every
-- request also carries X-Request-ID "u<update_id>", which the gateway echoes, so the ids of the
-- updates answered 200 can be written to WEBHOOKS_ACKED_FILE and checked against the inbox.
--
-- Environment: WEBHOOKS_SECRET (the X-Telegram-Bot-Api-Secret-Token value), WEBHOOKS_ID_BASE
-- (integer), WEBHOOKS_ACKED_FILE (optional path). done() prints machine-readable lines that start
-- with "webhooks:" after wrk's own report.

local secret = os.getenv("WEBHOOKS_SECRET") or "bench-secret"
local id_base = tonumber(os.getenv("WEBHOOKS_ID_BASE") or "0")
local acked_file = os.getenv("WEBHOOKS_ACKED_FILE")
local THREAD_SPAN = 10000000

local BODY = '{"update_id":%d,"message":{"message_id":%d,'
  .. '"from":{"id":%d,"is_bot":false,"first_name":"Alice","last_name":"Moreau",'
  .. '"username":"alice_m","language_code":"en"},'
  .. '"chat":{"id":%d,"first_name":"Alice","last_name":"Moreau","username":"alice_m","type":"private"},'
  .. '"date":1767225600,"text":"Hello! Can you help me book a table for two?"}}'

-- The main state: number the threads and keep them for done().
local threads = {}

function setup(thread)
  table.insert(threads, thread)
  thread:set("thread_index", #threads)
end

-- Each thread's own state; globals, since done() reads them with thread:get().
first_id = 0
sent = 0
accepted_new = 0
statuses = {}
acked = {}
acked_count = 0
local headers = {}

function init(args)
  first_id = id_base + thread_index * THREAD_SPAN
  headers["Content-Type"] = "application/json"
  headers["X-Telegram-Bot-Api-Secret-Token"] = secret
end

function request()
  sent = sent + 1
  local update_id = first_id + sent
  local chat = 100000 + sent % 500 -- 500 private chats, so many sessions
  headers["X-Request-ID"] = "u" .. update_id
  return wrk.format("POST", nil, headers, string.format(BODY, update_id, sent, chat, chat))
end

function response(status, hdrs, body)
  statuses[status] = (statuses[status] or 0) + 1
  if status == 200 then
    if string.find(body, '"new":1', 1, true) then
      accepted_new = accepted_new + 1
    end
    local rid = hdrs["x-request-id"] or hdrs["X-Request-ID"]
    if rid then
      acked_count = acked_count + 1
      acked[acked_count] = rid
    end
  end
end

function done(summary, latency, requests)
  local total_sent, total_new, total_acked = 0, 0, 0
  local by_status = {}
  local out = acked_file and io.open(acked_file, "w") or nil
  for index, thread in ipairs(threads) do
    local thread_sent = thread:get("sent")
    total_sent = total_sent + thread_sent
    io.write(string.format("webhooks: thread_sent %d %d\n", index, thread_sent))
    total_new = total_new + thread:get("accepted_new")
    for code, count in pairs(thread:get("statuses")) do
      by_status[code] = (by_status[code] or 0) + count
    end
    local ids = thread:get("acked")
    total_acked = total_acked + #ids
    if out then
      for _, rid in ipairs(ids) do
        out:write(rid, "\n")
      end
    end
  end
  if out then
    out:close()
  end
  io.write(string.format("webhooks: duration_us %d\n", summary.duration))
  io.write(string.format("webhooks: responses %d\n", summary.requests))
  io.write(string.format("webhooks: sent %d\n", total_sent))
  io.write(string.format("webhooks: accepted_new %d\n", total_new))
  io.write(string.format("webhooks: acked_ids %d\n", total_acked))
  io.write(string.format("webhooks: p99_us %d\n", latency:percentile(99)))
  local e = summary.errors
  io.write(
    string.format(
      "webhooks: errors connect %d read %d write %d status %d timeout %d\n",
      e.connect,
      e.read,
      e.write,
      e.status,
      e.timeout
    )
  )
  for code, count in pairs(by_status) do
    io.write(string.format("webhooks: status %d %d\n", code, count))
  end
end
