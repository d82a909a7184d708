-- The routing table in a lua_shared_dict, owned by ome-gateway-publisher.
--
-- Keys: "m:<namespace>/<name>" holds one map's entry (the JSON text the sidecar sent, kept
-- verbatim so both sides compute the same checksum); "h:<hostname>" names the map that owns a
-- hostname; "meta:*" holds the boot id, the version and the checksum. A batch is validated whole
-- before any of it is applied, and a batch the dict has no room for is undone: nothing else in
-- the table changes (safe_set never evicts).
local cjson = require("cjson.safe")

local _M = {}

local DICT_NAME = "ome_routes"
local CHECKSUM_MODULUS = 2 ^ 52 -- 13 hex digits of an md5: exact in a double, summed mod 2^52
local MAX_BACKENDS = 64
local MAX_ADDRESSES = 16
local MAX_WEIGHT = 1000000

local HOSTNAME = [[^(\*\.)?[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$]]
local SUBDOMAIN = [[^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$]]
local LABEL = [[^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$]]
local NAME = [[^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*$]]
local IPV4 = [[^(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])(\.(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])){3}$]]
local IPV6 = [[^[0-9a-f:.]{2,45}$]]
local ENDPOINT = [[^https?://[A-Za-z0-9.:\[\]-]+(:[0-9]{1,5})?/?$]]

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
end

local function entry_hash(key, text)
    return tonumber(ngx.md5(key .. "\n" .. text):sub(1, 13), 16)
end

-- Why `entry` (decoded) is not a valid entry for map `key`, or nil.
local function entry_problem(key, entry)
    if type(entry) ~= "table" then return "is not an object" end
    for field in pairs(entry) do
        if field ~= "hostname" and field ~= "rewrite_host" and field ~= "backends" then
            return "has unknown field " .. tostring(field)
        end
    end
    if not matches(entry.hostname, HOSTNAME) or #entry.hostname > 253 then
        return "hostname is not a lower-case DNS name"
    end
    if type(entry.rewrite_host) ~= "boolean" then return "rewrite_host is not a boolean" end
    local backends = entry.backends
    if type(backends) ~= "table" or #backends > MAX_BACKENDS then
        return "backends is not a list of at most " .. MAX_BACKENDS
    end
    for field in pairs(backends) do
        if not is_int(field, 1, #backends) then return "backends is not a list" end
    end
    local clusters = {}
    for i, backend in ipairs(backends) do
        local where = "backends[" .. i .. "]"
        if type(backend) ~= "table" then return where .. " is not an object" end
        for field in pairs(backend) do
            if field ~= "cluster" and field ~= "endpoint" and field ~= "weight" and field ~= "scheme"
                and field ~= "name" and field ~= "port" and field ~= "addresses" then
                return where .. " has unknown field " .. tostring(field)
            end
        end
        if not matches(backend.cluster, SUBDOMAIN) then return where .. ".cluster is not a DNS-1123 subdomain" end
        if clusters[backend.cluster] then return where .. ".cluster appears twice" end
        clusters[backend.cluster] = true
        if not matches(backend.endpoint, ENDPOINT) or #backend.endpoint > 300 then
            return where .. ".endpoint is not an http(s) URL with a plain host"
        end
        if not is_int(backend.weight, 0, MAX_WEIGHT) then return where .. ".weight is outside 0.." .. MAX_WEIGHT end
        if backend.scheme ~= "http" and backend.scheme ~= "https" then return where .. ".scheme is not http or https" end
        if not matches(backend.name, NAME) and not matches(backend.name, IPV6) then
            return where .. ".name is not a host name"
        end
        if not is_int(backend.port, 1, 65535) then return where .. ".port is outside 1..65535" end
        local addresses = backend.addresses
        if type(addresses) ~= "table" or #addresses < 1 or #addresses > MAX_ADDRESSES then
            return where .. ".addresses is not a list of 1.." .. MAX_ADDRESSES .. " IP addresses"
        end
        for _, address in ipairs(addresses) do
            if not matches(address, IPV4) and not (matches(address, IPV6) and address:find(":", 1, true)) then
                return where .. ".addresses holds " .. tostring(address) .. ", not an IP address"
            end
        end
    end
    return nil
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

-- Validates the whole batch {set = {key = entry text}, delete = {key}, replace = bool} against
-- the table; returns the plan (old and new text per key, hostname moves) or nil and a reason.
local function plan(batch)
    local dict = _M.dict()
    if type(batch) ~= "table" then return nil, "the batch is not an object" end
    for field in pairs(batch) do
        if field ~= "set" and field ~= "delete" and field ~= "replace" and field ~= "expect_boot" then
            return nil, "the batch has unknown field " .. tostring(field)
        end
    end
    local sets = batch.set or {}
    local deletes = batch.delete or {}
    if type(sets) ~= "table" or type(deletes) ~= "table" then return nil, "set or delete has the wrong type" end
    local changes = {} -- key -> {text = new text or false, entry = decoded}
    for key, text in pairs(sets) do
        local problem = key_problem(key)
        if problem then return nil, problem end
        if type(text) ~= "string" then return nil, key .. ": the entry is not a JSON text" end
        local entry = cjson.decode(text)
        problem = entry_problem(key, entry)
        if problem then return nil, key .. ": " .. problem end
        changes[key] = { text = text, entry = entry }
    end
    for i, key in ipairs(deletes) do
        local problem = key_problem(key)
        if problem then return nil, problem end
        if changes[key] then return nil, key .. ": both set and deleted" end
        changes[key] = { text = false }
    end
    if batch.replace == true then
        for key in pairs(_M.entries()) do
            if changes[key] == nil then changes[key] = { text = false } end
        end
    elseif batch.replace ~= nil and batch.replace ~= false then
        return nil, "replace is not a boolean"
    end
    -- Hostnames: freed by every change first, then claimed; a claim on a hostname that a map
    -- outside the batch holds, or that two maps in the batch claim, is refused.
    local owners = {}
    for key, change in pairs(changes) do
        change.old = dict:get("m:" .. key)
        if change.old then
            local old_entry = cjson.decode(change.old)
            change.old_hostname = old_entry and old_entry.hostname
        end
    end
    for key, change in pairs(changes) do
        if change.text then
            local hostname = change.entry.hostname
            if owners[hostname] then return nil, "hostname " .. hostname .. " is claimed by " .. owners[hostname] .. " and " .. key end
            owners[hostname] = key
            local holder = dict:get("h:" .. hostname)
            if holder and holder ~= key and changes[holder] == nil then
                return nil, key .. ": hostname " .. hostname .. " is held by " .. holder
            end
        end
    end
    return changes
end

-- Applies a planned batch; on a full dict, undoes what it did and returns nil, "table full".
local function apply(changes)
    local dict = _M.dict()
    local done = {} -- {dict key, previous value} in the order written
    local function put(name, value)
        local previous = dict:get(name)
        local ok, err
        if value == nil then
            dict:delete(name)
            ok = true
        else
            ok, err = dict:safe_set(name, value)
        end
        if ok then done[#done + 1] = { name, previous } end
        return ok, err
    end
    local function undo()
        for i = #done, 1, -1 do
            local name, previous = done[i][1], done[i][2]
            dict:delete(name)
            if previous ~= nil then dict:safe_set(name, previous) end
        end
    end
    -- Removals first: they free room for what the batch adds.
    for key, change in pairs(changes) do
        if change.old_hostname and dict:get("h:" .. change.old_hostname) == key then
            put("h:" .. change.old_hostname, nil)
        end
        if not change.text and change.old then put("m:" .. key, nil) end
    end
    local checksum = dict:get("meta:checksum") or 0
    local maps = 0
    for key, change in pairs(changes) do
        if change.text then
            local ok, err = put("m:" .. key, change.text)
            if ok then ok, err = put("h:" .. change.entry.hostname, key) end
            if not ok then
                undo()
                return nil, "table full (" .. tostring(err) .. "): raise the shared-dict size"
            end
            checksum = (checksum + entry_hash(key, change.text)) % CHECKSUM_MODULUS
            if not change.old then maps = maps + 1 end
        elseif change.old then
            maps = maps - 1
        end
        if change.old then checksum = (checksum - entry_hash(key, change.old)) % CHECKSUM_MODULUS end
    end
    -- meta:* were added at init and only change value in place, so these writes need no room.
    dict:set("meta:checksum", checksum)
    dict:incr("meta:maps", maps, 0)
    dict:incr("meta:version", 1, 0)
    return true
end

-- Validates and applies one batch; returns true, or false, an HTTP status and a reason.
function _M.apply_batch(batch)
    local changes, reason = plan(batch)
    if not changes then return false, 400, reason end
    local ok, err = apply(changes)
    if not ok then return false, 507, err end
    return true
end

return _M
