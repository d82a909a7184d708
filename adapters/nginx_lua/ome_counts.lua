-- Request counts per map backend, for ome-gateway-publisher's served-split check.
--
-- The access phase names the backend it picked (note); the log phase counts it once the request
-- is done (count), whatever its outcome, in a lua_shared_dict of its own so counters never take
-- room from the routing table. Keys: "<namespace>/<name>|<cluster>" -> requests since NGINX
-- started. Counters only grow; a full dict evicts the least recently used one, which then starts
-- again from 0: the sidecar reads a counter that went down as a restart of the count.
-- POST /counts (the control listener) answers, for the keys of its body (one a line, in pages the
-- sidecar chooses, so no read walks the whole dict), their counts in the same order and the boot
-- id of the table, which a restart changes.
local cjson = require("cjson.safe")
local table_ = require("ome_table")

local _M = {}

local DICT_NAME = "ome_counts"
local MAX_KEYS = 20000

function _M.note(map_key, cluster)
    ngx.ctx.ome_count = map_key .. "|" .. cluster
end

function _M.count()
    local key = ngx.ctx.ome_count
    if key == nil then return end
    local dict = ngx.shared[DICT_NAME]
    if dict ~= nil then dict:incr(key, 1, 0) end
end

-- The answer to POST /counts: status and body.
function _M.read(body)
    local dict = ngx.shared[DICT_NAME]
    if dict == nil then return 501, { error = "lua_shared_dict " .. DICT_NAME .. " is not declared: request counting is off" } end
    if body == nil then return 400, { error = "the body is missing or larger than the control listener's body buffer" } end
    local counts = {}
    for key in body:gmatch("[^\n]+") do
        if #counts == MAX_KEYS then return 400, { error = "at most " .. MAX_KEYS .. " keys a request" } end
        counts[#counts + 1] = dict:get(key) or 0
    end
    return 200, { boot = table_.dict():get("meta:boot"), counts = counts }
end

return _M
