-- Routing for ome-gateway-publisher: the pick in the access phase, the peer in the balancer.
--
-- access() finds the request's map by Host (exact name first, then the longest "*." suffix),
-- picks a backend by smooth weighted round robin (per worker), and sets $ome_upstream (the http or
-- the https upstream), $ome_sni and $ome_host before proxy_pass runs: SNI and the Host header
-- cannot change in the balancer. balance() only sets the chosen backend's address and, on a
-- retry, moves to its next address; it does no I/O. Unknown host: 404; every weight 0: 503.
local balancer = require("ngx.balancer")
local lrucache = require("resty.lrucache") -- lua-resty-core depends on it
local table_ = require("ome_table")
local counts = require("ome_counts")

local _M = {}

-- Per worker: hostname -> {text = entry text, entry = decoded, current = SWRR state}. A changed
-- entry text (another string) resets the state, so a weight change is live on the next request.
-- An LRU, so hostnames that come and go cannot grow a worker without bound; an evicted host only
-- starts its round robin afresh.
local CACHED_HOSTS = 65536
local cache = assert(lrucache.new(CACHED_HOSTS))

local UPSTREAMS = { http = "http://ome_plain", https = "https://ome_tls" }

local function lookup(dict, host)
    local key = dict:get("h:" .. host)
    if key then return host, key end
    local rest = host
    while true do
        local dot = rest:find(".", 1, true)
        if not dot then return nil end
        rest = rest:sub(dot + 1)
        local wildcard = "*." .. rest
        key = dict:get("h:" .. wildcard)
        if key then return wildcard, key end
    end
end

local function pick(state)
    local backends = state.entry.backends
    local current = state.current
    local total, best = 0, nil
    for i, backend in ipairs(backends) do
        local weight = backend.weight
        if weight > 0 then
            current[i] = current[i] + weight
            total = total + weight
            if best == nil or current[i] > current[best] then best = i end
        end
    end
    if best then current[best] = current[best] - total end
    return best
end

function _M.access()
    local dict = table_.dict()
    local host = ngx.var.host
    local hostname, key = lookup(dict, host)
    if not hostname then return ngx.exit(ngx.HTTP_NOT_FOUND) end
    local text = dict:get("m:" .. key)
    if not text then return ngx.exit(ngx.HTTP_NOT_FOUND) end
    local state = cache:get(hostname)
    if state == nil or state.text ~= text then
        local entry = table_.decode_entry(text)
        if not entry then return ngx.exit(ngx.HTTP_INTERNAL_SERVER_ERROR) end
        local current = {}
        for i = 1, #entry.backends do current[i] = 0 end
        state = { text = text, entry = entry, current = current, next_address = 0 }
        cache:set(hostname, state)
    end
    local index = pick(state)
    if not index then return ngx.exit(ngx.HTTP_SERVICE_UNAVAILABLE) end
    local backend = state.entry.backends[index]
    ngx.var.ome_upstream = UPSTREAMS[backend.scheme]
    ngx.var.ome_sni = backend.name
    ngx.var.ome_host = state.entry.rewrite_host and backend.name or host
    state.next_address = state.next_address + 1
    ngx.ctx.ome_backend = backend
    ngx.ctx.ome_first = state.next_address
    counts.picked(key, backend.cluster)
end

function _M.balance()
    local ctx = ngx.ctx
    local backend = ctx.ome_backend
    if not backend then return ngx.exit(ngx.HTTP_INTERNAL_SERVER_ERROR) end
    local addresses = backend.addresses
    local tries = ctx.ome_tries or 0
    if tries == 0 and #addresses > 1 then
        -- A retry stays on the chosen backend (its other addresses): SNI and Host are already
        -- set for it, and a weight-0 backend must never get a request.
        balancer.set_more_tries(#addresses - 1)
    end
    ctx.ome_tries = tries + 1
    local address = addresses[(ctx.ome_first + tries) % #addresses + 1]
    local ok, err = balancer.set_current_peer(address, backend.port)
    if not ok then
        ngx.log(ngx.ERR, "ome-gateway-publisher: cannot set peer ", address, ": ", err)
        return ngx.exit(ngx.HTTP_INTERNAL_SERVER_ERROR)
    end
end

return _M
