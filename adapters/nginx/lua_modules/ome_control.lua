-- The control listener of ome-gateway-publisher: the only writer of the routing table.
--
-- Every request must carry "Authorization: Bearer <secret>", the secret read from a file at
-- start (or reload). GET /state answers the boot id, version, checksum and table bytes (JSON);
-- GET /table is that line followed by one "<namespace>/<name> <entry>" line per map (the
-- read-back); GET /changes?boot=BOOT&since=VERSION[&wait=SECONDS] is the state line followed by
-- "set <namespace>/<name> <entry>" or "delete <namespace>/<name>" per map changed after VERSION,
-- from the change log without the batch lock (410: too old, another boot or ahead: read /table);
-- with wait, it answers once the version moves past VERSION or the wait ends. POST /batch
-- (format in ome_table.parse_batch) validates a whole batch and applies all of it or nothing (400
-- with a reason, 507 when the table is full, 409 when expect_boot names another boot, 500 when a
-- refused batch could not be undone whole), answering with the state. POST /counts answers request
-- counts per map backend (ome_counts).
local cjson = require("cjson.safe")
local table_ = require("ome_table")
local counts = require("ome_counts")

local _M = {}

local secret_digest = nil

-- Runs in init_by_lua (as root, before workers drop privileges): no secret, no start.
function _M.init(secret_file)
    local file, err = io.open(secret_file, "rb")
    if not file then error("ome-gateway-publisher: cannot read the secret file: " .. tostring(err)) end
    local text = file:read("*a")
    file:close()
    text = text:gsub("^%s+", ""):gsub("%s+$", "")
    if #text < 16 then error("ome-gateway-publisher: the secret in " .. secret_file .. " is shorter than 16 characters") end
    secret_digest = ngx.sha1_bin(text)
    table_.init()
end

local function reply(status, body)
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    ngx.print(cjson.encode(body))
    return ngx.exit(status)
end

-- Whether `given` is the secret, in the same steps whatever `given` is: digests of one length
-- are compared byte by byte to the end, so neither where a guess goes wrong nor its length shows
-- in the time taken.
function _M.is_secret(given)
    local digest = ngx.sha1_bin(given)
    local differ = 0
    for i = 1, #secret_digest do
        differ = bit.bor(differ, bit.bxor(digest:byte(i), secret_digest:byte(i)))
    end
    return differ == 0
end

local function authorized()
    local header = ngx.var.http_authorization
    if type(header) ~= "string" then return false end
    local given = header:match("^Bearer (.+)$")
    return given ~= nil and _M.is_secret(given)
end

-- Whether the process a lock value names ("<pid> <count>") is still running.
local function holder_alive(holder)
    local pid = holder:match("^(%d+) ")
    local stat = pid and io.open("/proc/" .. pid .. "/stat", "rb")
    if not stat then return false end
    stat:close()
    return true
end

-- One batch at a time across workers. The lock has no expiry, so a long batch never loses it
-- halfway; it names its holder, and a waiter takes it over only from a process that is gone (a
-- worker that died holding it). The break key lets one waiter alone remove a given dead holder's
-- lock, so two cannot each remove the other's fresh one.
local acquisitions = 0
local function locked(dict, work)
    acquisitions = acquisitions + 1
    local mine = ngx.worker.pid() .. " " .. acquisitions
    for _ = 1, 500 do
        if dict:safe_add("meta:lock", mine) then
            local ok, a, b, c = pcall(work)
            dict:delete("meta:lock")
            if not ok then error(a) end
            return a, b, c
        end
        local holder = dict:get("meta:lock")
        if holder and not holder_alive(holder) and dict:safe_add("meta:lock_break:" .. holder, true, 60)
            and dict:get("meta:lock") == holder then
            ngx.log(ngx.WARN, "ome-gateway-publisher: taking over the batch lock of a worker that is gone: ", holder)
            dict:delete("meta:lock")
        else
            ngx.sleep(0.002)
        end
    end
    return false, 503, "another batch is being applied"
end

local function batch()
    ngx.req.read_body()
    local body = ngx.req.get_body_data()
    if body == nil then
        return reply(400, { error = "the batch body is missing or larger than the control listener's body buffer" })
    end
    local head, sets, deletes = table_.parse_batch(body)
    if not head then
        local answer = table_.state()
        answer.error = sets
        return reply(400, answer)
    end
    local dict = table_.dict()
    local ok, status, reason = locked(dict, function()
        if head.expect_boot ~= nil and head.expect_boot ~= dict:get("meta:boot") then
            return false, 409, "the table belongs to another NGINX start"
        end
        return table_.apply_batch(head, sets, deletes)
    end)
    if not ok then
        local body_out = table_.state()
        body_out.error = reason
        return reply(status, body_out)
    end
    return reply(200, table_.state())
end

-- A reader long-polling /changes checks the version this often (about 2 % of a worker's core
-- while it waits; versions move in any worker, so there is nothing to wait on); at most this long.
local WAIT_STEP = 0.001
local MAX_WAIT = 30

local function changes()
    local args = ngx.req.get_uri_args()
    local since, wait, boot = tonumber(args.since), tonumber(args.wait or 0), args.boot
    if not since or since < 0 or since ~= math.floor(since) or not wait or wait < 0 or wait > MAX_WAIT
        or type(boot) ~= "string" then
        return reply(400, { error = "expected boot=BOOT&since=VERSION[&wait=0.." .. MAX_WAIT .. "]" })
    end
    local dict = table_.dict()
    local deadline = ngx.now() + wait
    while dict:get("meta:version") == since and dict:get("meta:boot") == boot and ngx.now() < deadline do
        ngx.sleep(WAIT_STEP)
    end
    local state, changed
    if boot == dict:get("meta:boot") then state, changed = table_.changes(since) end
    if not state then
        local answer = table_.state()
        if changed == "busy" then
            answer.error = "batches kept writing: ask again"
            return reply(503, answer)
        end
        answer.error = "the changes since version " .. since .. " of boot " .. boot .. " are not kept: read /table instead"
        return reply(410, answer)
    end
    local lines = { cjson.encode(state) }
    for key, text in pairs(changed) do
        lines[#lines + 1] = text and ("set " .. key .. " " .. text) or ("delete " .. key)
    end
    lines[#lines + 1] = ""
    ngx.header["Content-Type"] = "text/plain"
    ngx.print(table.concat(lines, "\n"))
    return ngx.exit(200)
end

function _M.handle()
    if not authorized() then return reply(401, { error = "missing or wrong shared secret" }) end
    local method, uri = ngx.req.get_method(), ngx.var.uri
    if uri == "/state" and method == "GET" then return reply(200, table_.state()) end
    if uri == "/table" and method == "GET" then
        -- Under the batch lock, so the entries are the ones the checksum is of.
        local ok, lines = locked(table_.dict(), function()
            local lines = { cjson.encode(table_.state()) }
            for key, text in pairs(table_.entries()) do
                lines[#lines + 1] = key .. " " .. text
            end
            return true, lines
        end)
        if not ok then return reply(503, { error = "another batch is being applied" }) end
        ngx.header["Content-Type"] = "text/plain"
        lines[#lines + 1] = ""
        ngx.print(table.concat(lines, "\n"))
        return ngx.exit(200)
    end
    if uri == "/changes" and method == "GET" then return changes() end
    if uri == "/batch" and method == "POST" then return batch() end
    if uri == "/counts" and method == "POST" then
        ngx.req.read_body()
        return reply(counts.read(ngx.req.get_body_data()))
    end
    return reply(404, { error = "no such control endpoint" })
end

return _M
