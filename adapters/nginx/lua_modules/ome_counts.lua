-- Request counts per map backend, for ome-gateway-publisher's served-split check.
--
-- The access phase counts the backend it picked (picked), when it picks it: a request is counted
-- as it starts, whatever its outcome and however long it streams, so a stream picked before a
-- drain and answered minutes after it counts before it. A retry stays on the picked backend and is
-- not counted again; a request refused before a pick (unknown host, every weight 0) is not counted.
-- Counters live in a lua_shared_dict of their own so they never take room from the routing table.
-- Keys: "<namespace>/<name>|<cluster>" -> requests since NGINX started. Counters only grow; a full
-- dict evicts the least recently used one, which then starts again from 0 in a new generation: the
-- sidecar reads a counter of another generation (or one that went down) as a restart of that map's
-- count.
-- POST /counts (the control listener) answers, for the keys of its body (one a line, in pages the
-- sidecar chooses, so no read walks the whole dict), their counts and generations (0: no counter)
-- in the same order and the boot id of the table, which a restart changes.
local cjson = require("cjson.safe")
local table_ = require("ome_table")

local _M = {}

local DICT_NAME = "ome_counts"
local MAX_KEYS = 20000

-- A counter's value is generation * GENERATION + requests. Each counter made (the first request,
-- or the first after an eviction) takes the next generation, so the sidecar tells a counter that
-- was evicted and counted again from the one it read before, whatever the two counted: comparing
-- counts alone, one that grew back past its old value would be misread as a delta.
local GENERATION = 4294967296 -- 2^32 requests; generations wrap at 2^20, within a double's 53 bits
local GENERATIONS = 1048576

function _M.picked(map_key, cluster)
    local dict = ngx.shared[DICT_NAME]
    if dict == nil then return end
    local key = map_key .. "|" .. cluster
    if dict:incr(key, 1) == nil then
        local generation = (dict:incr("meta:generations", 1, 0) or 0) % GENERATIONS + 1
        -- Another worker may make it first: then this only adds 1 to that one.
        dict:incr(key, 1, generation * GENERATION)
    end
end

-- The log phase's call (in configs that nginx-config wrote when it counted there): counting moved
-- to the pick, and a config that still calls it must not fail every request's log phase.
function _M.count() end

-- The answer to POST /counts: status and body.
function _M.read(body)
    local dict = ngx.shared[DICT_NAME]
    if dict == nil then return 501, { error = "lua_shared_dict " .. DICT_NAME .. " is not declared: request counting is off" } end
    if body == nil then return 400, { error = "the body is missing or larger than the control listener's body buffer" } end
    local counts, generations = {}, {}
    for key in body:gmatch("[^\n]+") do
        if #counts == MAX_KEYS then return 400, { error = "at most " .. MAX_KEYS .. " keys a request" } end
        local value = dict:get(key) or 0
        counts[#counts + 1] = value % GENERATION
        generations[#generations + 1] = math.floor(value / GENERATION)
    end
    return 200, { boot = table_.dict():get("meta:boot"), counts = counts, generations = generations }
end

return _M
