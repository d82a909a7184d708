-- The routing table in a lua_shared_dict, owned by ome-gateway-publisher.
--
-- Keys: "m:<namespace>/<name>" holds one map's entry (the JSON text the sidecar sent, kept
-- verbatim so both sides compute the same checksum); "h:<hostname>" names the map that owns a
-- hostname; "meta:*" holds the boot id, the version and the checksum. A batch is validated whole
-- before any of it is applied, and a batch the dict has no room for is undone, every key back to
-- the value it had: nothing else in the table changes (safe_set never evicts). A replace batch
-- counts the checksum afresh, so it also repairs a table that no longer matches its own. "c:<version>" is the change log: the maps batch
-- <version> changed, kept for the versions above meta:log_floor, so a reader can ask what changed
-- since a version in O(changed) without the batch lock; meta:writes is odd while a batch writes.
local cjson = require("cjson.safe")

local _M = {}

local DICT_NAME = "ome_routes"
local CHECKSUM_MODULUS = 2 ^ 52 -- 13 hex digits of an md5: exact in a double, summed mod 2^52
local MAX_BACKENDS = 64
local MAX_ADDRESSES = 16
local MAX_WEIGHT = 1000000
-- The change log's bounds: about 10 s of history at 100 single-map batches a second, and at most
-- LOG_MAPS map keys in all (a larger batch, like a first publish, empties the log). It takes up
-- to about 0.25 MB of the dict (128 KB measured for 1,024 one-map batches); a reader further
-- behind reads the whole table.
local LOG_VERSIONS = 1024
local LOG_MAPS = 4096

local HOSTNAME = [[^(\*\.)?[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$]]
local SUBDOMAIN = [[^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$]]
local LABEL = [[^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$]]
local IPV4 = [[^(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])(\.(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])){3}$]]
local IPV6 = [[^[0-9a-f:.]{2,45}$]]
-- Captures: scheme, host (a DNS name, IPv4, or bracketed IPv6), port; as publisher.model checks it.
local ENDPOINT = [[^(https?)://((?:[A-Za-z0-9](?:[-A-Za-z0-9]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[-A-Za-z0-9]*[A-Za-z0-9])?)*)|\[[0-9A-Fa-f:.]+\])(?::([0-9]{1,5}))?/?$]]

local function matches(value, pattern)
    return type(value) == "string" and ngx.re.find(value, pattern, "jo") ~= nil
end

local function is_int(value, low, high)
    return type(value) == "number" and value == math.floor(value) and value >= low and value <= high
end

function _M.dict()
    return ngx.shared[DICT_NAME]
end

-- Runs in init_by_lua: a reload keeps the dict and so the boot id; a restart starts a new one.
function _M.init()
    local dict = _M.dict()
    if dict == nil then
        error("ome-gateway-publisher: lua_shared_dict " .. DICT_NAME .. " is not declared")
    end
    local random = io.open("/dev/urandom", "rb")
    local seed = random and random:read(8) or tostring(ngx.now())
    if random then random:close() end
    local boot = ngx.md5(seed .. tostring(ngx.now()) .. tostring(ngx.worker.pid())):sub(1, 16)
    dict:safe_add("meta:boot", boot)
    dict:safe_add("meta:version", 0)
    dict:safe_add("meta:checksum", 0)
    dict:safe_add("meta:maps", 0)
    dict:safe_add("meta:writes", 0)
    dict:safe_add("meta:log_floor", 0)
    dict:safe_add("meta:log_maps", 0)
end

local function entry_hash(key, text)
    return tonumber(ngx.md5(key .. "\n" .. text):sub(1, 13), 16)
end

-- One map's entry text, decoded and checked: {hostname, rewrite_host, backends = {{cluster,
-- endpoint, weight, scheme, name, port, addresses}}}; or nil and why it is not a valid entry.
-- The text is {"h": hostname, "r": rewrite_host, "b": [[cluster, endpoint, weight, [address]]]}.
function _M.decode_entry(text)
    local raw = cjson.decode(text)
    if type(raw) ~= "table" then return nil, "is not a JSON object" end
    for field in pairs(raw) do
        if field ~= "h" and field ~= "r" and field ~= "b" then return nil, "has unknown field " .. tostring(field) end
    end
    if not matches(raw.h, HOSTNAME) or #raw.h > 253 then return nil, "hostname is not a lower-case DNS name" end
    if type(raw.r) ~= "boolean" then return nil, "rewrite_host is not a boolean" end
    local list = raw.b
    if type(list) ~= "table" or #list > MAX_BACKENDS then return nil, "backends is not a list of at most " .. MAX_BACKENDS end
    for field in pairs(list) do
        if not is_int(field, 1, #list) then return nil, "backends is not a list" end
    end
    local backends, clusters = {}, {}
    for i, item in ipairs(list) do
        local where = "backends[" .. i .. "]"
        if type(item) ~= "table" or #item ~= 4 then return nil, where .. " is not [cluster, endpoint, weight, addresses]" end
        for field in pairs(item) do
            if not is_int(field, 1, 4) then return nil, where .. " is not a list" end
        end
        local cluster, endpoint, weight, addresses = item[1], item[2], item[3], item[4]
        if not matches(cluster, SUBDOMAIN) then return nil, where .. ".cluster is not a DNS-1123 subdomain" end
        if clusters[cluster] then return nil, where .. ".cluster appears twice" end
        clusters[cluster] = true
        local parts = type(endpoint) == "string" and #endpoint <= 300 and ngx.re.match(endpoint, ENDPOINT, "jo")
        if not parts then return nil, where .. ".endpoint is not an http(s) URL with a plain host" end
        local scheme, name, port = parts[1], parts[2], tonumber(parts[3] or (parts[1] == "https" and "443" or "80"))
        if port < 1 or port > 65535 then return nil, where .. ".endpoint port is outside 1..65535" end
        if name:sub(1, 1) == "[" then name = name:sub(2, -2) end
        if not is_int(weight, 0, MAX_WEIGHT) then return nil, where .. ".weight is outside 0.." .. MAX_WEIGHT end
        if type(addresses) ~= "table" or #addresses < 1 or #addresses > MAX_ADDRESSES then
            return nil, where .. ".addresses is not a list of 1.." .. MAX_ADDRESSES .. " IP addresses"
        end
        for field, address in pairs(addresses) do
            if not is_int(field, 1, #addresses)
                or not (matches(address, IPV4) or (matches(address, IPV6) and address:find(":", 1, true))) then
                return nil, where .. ".addresses holds " .. tostring(address) .. ", not an IP address"
            end
        end
        backends[i] = { cluster = cluster, endpoint = endpoint, weight = weight, scheme = scheme, name = name,
                        port = port, addresses = addresses }
    end
    return { hostname = raw.h, rewrite_host = raw.r, backends = backends }
end

-- Why `key` is not a map key ("namespace/name"), or nil.
local function key_problem(key)
    if type(key) ~= "string" then return "a map key is not a string" end
    local namespace, name = key:match("^([^/]+)/([^/]+)$")
    if not matches(namespace, LABEL) or not matches(name, SUBDOMAIN) or #name > 253 then
        return "map key " .. key .. " is not namespace/name"
    end
    return nil
end

function _M.state()
    local dict = _M.dict()
    local capacity = dict:capacity()
    local free = dict:free_space()
    return {
        boot = dict:get("meta:boot"),
        version = dict:get("meta:version"),
        checksum = string.format("%013x", dict:get("meta:checksum") or 0),
        maps = dict:get("meta:maps") or 0,
        bytes_capacity = capacity,
        bytes_free = free,
        bytes_used = capacity - free,
    }
end

-- Every map's entry text, keyed by "namespace/name".
function _M.entries()
    local dict = _M.dict()
    local out = {}
    for _, key in ipairs(dict:get_keys(0)) do
        if key:sub(1, 2) == "m:" then
            local text = dict:get(key)
            if text ~= nil then out[key:sub(3)] = text end
        end
    end
    return out
end

-- Validates a whole batch against the table: `head` is {expect_boot, replace}, `sets` maps key
-- to entry text, `deletes` lists keys. Returns the plan (old and new text per key) or nil and why.
local function plan(head, sets, deletes)
    local dict = _M.dict()
    for field in pairs(head) do
        if field ~= "replace" and field ~= "expect_boot" then
            return nil, "the batch has unknown field " .. tostring(field)
        end
    end
    local changes = {} -- key -> {text = new text or false, entry = decoded, old = text, old_hostname}
    for key, text in pairs(sets) do
        local problem = key_problem(key)
        if problem then return nil, problem end
        local entry, reason = _M.decode_entry(text)
        if not entry then return nil, key .. ": the entry " .. reason end
        changes[key] = { text = text, entry = entry }
    end
    for _, key in ipairs(deletes) do
        local problem = key_problem(key)
        if problem then return nil, problem end
        if changes[key] then return nil, key .. ": both set and deleted" end
        changes[key] = { text = false }
    end
    if head.replace == true then
        for key in pairs(_M.entries()) do
            if changes[key] == nil then changes[key] = { text = false } end
        end
    elseif head.replace ~= nil and head.replace ~= false then
        return nil, "replace is not a boolean"
    end
    -- Hostnames: freed by every change first, then claimed; a claim on a hostname that a map
    -- outside the batch holds, or that two maps in the batch claim, is refused.
    local owners = {}
    for key, change in pairs(changes) do
        change.old = dict:get("m:" .. key)
        if change.old then
            local old = cjson.decode(change.old)
            change.old_hostname = old and old.h
        end
    end
    for key, change in pairs(changes) do
        if change.text then
            local hostname = change.entry.hostname
            if owners[hostname] then return nil, "hostname " .. hostname .. " is claimed by " .. owners[hostname] .. " and " .. key end
            owners[hostname] = key
            local holder = dict:get("h:" .. hostname)
            -- A holder without an entry is a leftover of a damaged table, not an owner.
            if holder and holder ~= key and changes[holder] == nil and dict:get("m:" .. holder) ~= nil then
                return nil, key .. ": hostname " .. hostname .. " is held by " .. holder
            end
        end
    end
    return changes
end

-- Reads a batch body: a JSON object line ({"expect_boot": ..., "replace": ...}), then one line
-- per change, "set <namespace>/<name> <entry JSON>" or "delete <namespace>/<name>". Lines keep
-- entries out of an enclosing JSON string, so nothing is escaped twice.
function _M.parse_batch(body)
    local first = body:find("\n", 1, true)
    local head = cjson.decode(first and body:sub(1, first - 1) or body)
    if type(head) ~= "table" or head[1] ~= nil then return nil, "the first line is not a JSON object" end
    local sets, deletes = {}, {}
    local position = first and first + 1 or #body + 1
    local line = 1
    while position <= #body do
        local stop = body:find("\n", position, true) or #body + 1
        line = line + 1
        local verb, key, rest = body:sub(position, stop - 1):match("^(%l+) (%S+) ?(.*)$")
        if verb == "set" and rest ~= "" then
            if sets[key] then return nil, "line " .. line .. ": " .. key .. " is set twice" end
            sets[key] = rest
        elseif verb == "delete" and rest == "" then
            deletes[#deletes + 1] = key
        else
            return nil, "line " .. line .. " is neither 'set KEY ENTRY' nor 'delete KEY'"
        end
        position = stop + 1
    end
    return head, sets, deletes
end

-- Empties the change log: it then holds the changes after `version`. True if it held any.
local function drop_log(dict, version)
    local floor = dict:get("meta:log_floor") or 0
    for logged = floor + 1, version do dict:delete("c:" .. logged) end
    dict:set("meta:log_floor", version)
    dict:set("meta:log_maps", 0)
    return version > floor
end

-- Logs that batch `version` changed `changes`' keys, first trimming the oldest records to the
-- bounds; a batch over the bounds, or one the dict has no room to log, empties the log instead.
local function log_changes(dict, version, changes)
    local keys = {}
    for key in pairs(changes) do keys[#keys + 1] = key end
    if #keys > LOG_MAPS then
        drop_log(dict, version)
        return
    end
    local floor = dict:get("meta:log_floor") or 0
    local logged = dict:get("meta:log_maps") or 0
    while floor < version - 1 and (version - floor > LOG_VERSIONS or logged + #keys > LOG_MAPS) do
        floor = floor + 1
        local record = dict:get("c:" .. floor)
        if record then
            logged = logged - tonumber(record:match("^%d+"))
            dict:delete("c:" .. floor)
        end
    end
    dict:set("meta:log_floor", floor)
    if dict:safe_set("c:" .. version, #keys .. "\n" .. table.concat(keys, "\n")) then
        dict:set("meta:log_maps", logged + #keys)
    else
        drop_log(dict, version)
    end
end

-- Applies a planned batch; on a full dict, undoes what it did and returns nil, "table full"
-- (false as a third value when the undo could not put every previous value back).
local function apply(changes, replace)
    local dict = _M.dict()
    local done = {} -- {dict key, previous value} in the order written
    local function put(name, value)
        -- Recorded before writing: a safe_set that needs a larger slot frees the old value and
        -- then may fail for room, so the previous value is lost to the dict either way.
        done[#done + 1] = { name, dict:get(name) }
        if value == nil then
            dict:delete(name)
            return true
        end
        return dict:safe_set(name, value)
    end
    -- In reverse order, so each write's room is back before the value it replaced needs it.
    local function undo()
        local restored = true
        for i = #done, 1, -1 do
            local name, previous = done[i][1], done[i][2]
            dict:delete(name)
            if previous ~= nil and not dict:safe_set(name, previous) then restored = false end
        end
        return restored
    end
    -- Removals first: they free room for what the batch adds.
    for key, change in pairs(changes) do
        if change.old_hostname and dict:get("h:" .. change.old_hostname) == key then
            put("h:" .. change.old_hostname, nil)
        end
        if not change.text and change.old then put("m:" .. key, nil) end
    end
    -- A replace counts from nothing: the table it replaces may not match its own checksum.
    local checksum = replace and 0 or dict:get("meta:checksum") or 0
    local maps = replace and -(dict:get("meta:maps") or 0) or 0
    for key, change in pairs(changes) do
        if change.text then
            local ok, err = put("m:" .. key, change.text)
            if ok then ok, err = put("h:" .. change.entry.hostname, key) end
            if not ok then
                return nil, "table full (" .. tostring(err) .. "): raise the shared-dict size", undo()
            end
            checksum = (checksum + entry_hash(key, change.text)) % CHECKSUM_MODULUS
            if replace or not change.old then maps = maps + 1 end
        elseif change.old and not replace then
            maps = maps - 1
        end
        if change.old and not replace then checksum = (checksum - entry_hash(key, change.old)) % CHECKSUM_MODULUS end
    end
    -- Logged before the version moves: a reader that sees the new version finds its record.
    local version = (dict:get("meta:version") or 0) + 1
    log_changes(dict, version, changes)
    -- meta:* were added at init and only change value in place, so these writes need no room.
    dict:set("meta:checksum", checksum)
    dict:incr("meta:maps", maps, 0)
    dict:incr("meta:version", 1, 0)
    return true
end

-- Validates and applies one parsed batch; returns true, or false, an HTTP status and a reason.
-- 507: refused for room, the table exactly as before; 500: the undo could not restore it, and the
-- table no longer matches its checksum (the sidecar restores it whole).
function _M.apply_batch(head, sets, deletes)
    local changes, reason = plan(head, sets, deletes)
    if not changes then return false, 400, reason end
    local dict = _M.dict()
    dict:incr("meta:writes", 1, 0)
    local replace = head.replace == true
    local done, ok, err, restored = pcall(apply, changes, replace)
    if done and not ok and restored and drop_log(dict, dict:get("meta:version") or 0) then
        -- The log never costs a batch: its room goes to the table, and readers read /table.
        done, ok, err, restored = pcall(apply, changes, replace)
    end
    dict:incr("meta:writes", 1, 0)
    if not done then error(ok) end
    if not ok and not restored then return false, 500, err .. "; the undo could not restore every entry" end
    if not ok then return false, 507, err end
    return true
end

-- What changed after version `since`, as of one version: the state and {key = its entry text, or
-- false if deleted}; or nil and "gone" when the log no longer reaches back to `since` (or `since`
-- is ahead of the table), or "busy" when batches kept writing. Takes no lock: it retries while a
-- batch in another worker is writing (meta:writes odd, or moved while reading).
function _M.changes(since)
    local dict = _M.dict()
    for _ = 1, 2000 do
        local writes = dict:get("meta:writes")
        if writes % 2 == 0 then
            local state = _M.state()
            if since < (dict:get("meta:log_floor") or 0) or since > state.version then return nil, "gone" end
            local changed, complete = {}, true
            for logged = since + 1, state.version do
                local record = dict:get("c:" .. logged)
                if record == nil then
                    -- A batch trimmed it meanwhile (writes moved), or the log lost it: read /table.
                    if dict:get("meta:writes") == writes then return nil, "gone" end
                    complete = false
                    break
                end
                for key in record:gmatch("\n([^\n]+)") do changed[key] = true end
            end
            for key in pairs(changed) do changed[key] = dict:get("m:" .. key) or false end
            if complete and dict:get("meta:writes") == writes then return state, changed end
        end
        ngx.sleep(0.001)
    end
    return nil, "busy"
end

return _M
