-- Request counts per map backend, for ome-gateway-publisher's served-split check.
--
-- The access phase counts the backend it picked (picked), when it picks it: a request is counted
-- as it starts, whatever its outcome and however long it streams, so a stream picked before a
-- drain and answered minutes after it counts before it. A retry stays on the picked backend and is
-- not counted again; a request refused before a pick (unknown host, every weight 0) is not counted.
-- Counters live in a lua_shared_dict of their own so they never take room from the routing table.
-- Keys: "<namespace>/<name>|<cluster>" -> requests since NGINX started. Counters only grow; a full
-- dict evicts the least recently used one, which then starts again from 0: the sidecar reads a
-- counter that went down as a restart of that map's count.
-- POST /counts (the control listener) answers, for the keys of its body (one a line, in pages the
-- sidecar chooses, so no read walks the whole dict), their counts in the same order and the boot
-- id of the table, which a restart changes.
local cjson = require("cjson.safe")
local table_ = require("ome_table")

local _M = {}

local DICT_NAME = "ome_counts"
local MAX_KEYS = 20000

function _M.picked(map_key, cluster)
    local dict = ngx.shared[DICT_NAME]
    if dict ~= nil then dict:incr(map_key .. "|" .. cluster, 1, 0) end
end

-- The log phase's call (in configs that nginx-config wrote when it counted there): counting moved
-- to the pick, and a config that still calls it must not fail every request's log phase.
function _M.count() end

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
